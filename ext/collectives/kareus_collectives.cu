// SM-capped collectives among 2, 4 or 8 GPUs of one node over CUDA IPC peer memory.
//
// Every call takes the grid size (= the number of SMs the collective occupies: one
// block of KC_THREADS threads per SM) as an argument, so the caller decides exactly
// how many SMs communication takes away from computation.
//
// Memory model
// ------------
// Each rank owns one "staging" allocation that every peer has mapped through a CUDA
// IPC handle (or through PyTorch's symmetric memory). It holds a flag region
// (uint32 flags[KC_MAX_BLOCKS][KC_MAX_RANKS]) followed by a data region. Data moves
// by *pushing*: a block reads its share of the local input and stores it straight
// into the peers' data regions over NVLink; the receiving rank then reads its local
// data region. User tensors therefore need no IPC registration.
//
// Synchronisation
// ---------------
// There is no grid-wide barrier. Element ownership is a function of the element's
// vector index and the grid size only ((index / KC_THREADS) % grid), identical on all
// ranks because all ranks issue the same calls with the same grid size. Block b of
// rank r therefore only ever waits for block b of the other ranks: it bumps its own
// per-block counter, stores the new value into flags[b][r] of every peer with a
// system-scope release, and spins with system-scope acquires until flags[b][p] of
// its own flag region has reached that value for every peer p. Values only grow, so
// flags are never reset and a peer that is one barrier ahead is harmless.
//
// Every call starts with such a barrier: when block b of peer p has started call k,
// p's call k-1 has finished (calls on one communicator are stream-ordered), so its
// data region may be overwritten. Blocks of one rank never wait for each other, so
// the kernels cannot deadlock when other kernels occupy some SMs.
//
// Determinism
// -----------
// Reductions accumulate in fp32 in the fixed order rank 0, 1, ..., n-1, and each
// reduced element is computed by exactly one rank (two-shot) or by all ranks with
// the same operations in the same order (one-shot), so every rank ends up with
// bitwise-identical results.
//
// C ABI: see the extern "C" block at the end (loaded from Python with ctypes).

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define KC_MAX_RANKS 8
#define KC_MAX_BLOCKS 256
// Threads per block and loads in flight of the registered-buffer kernels are
// build-time knobs (the Python loader passes them as -D flags; each setting is its
// own cached build).
#ifndef KC_THREADS
#define KC_THREADS 512
#endif
// 16-byte loads each thread of a registered-buffer kernel keeps in flight.
#ifndef KC_INFLIGHT
#define KC_INFLIGHT (KC_THREADS > 512 ? 8 : 16)
#endif
#define KC_FLAG_BYTES (KC_MAX_BLOCKS * KC_MAX_RANKS * 4)
// Data region starts 64 KiB into the staging allocation (keeps it 16-byte aligned
// and leaves room for the flags).
#define KC_DATA_OFFSET 65536
#define KC_API_VERSION 2

namespace kc {

struct Peers {
  char* data[KC_MAX_RANKS];       // data region of each rank (own included)
  uint32_t* flags[KC_MAX_RANKS];  // flag region of each rank (own included)
};

struct Comm {
  Peers peers;
  uint32_t* counters;  // per-block barrier counters (local, not shared)
  int rank;
  int world;
  size_t data_bytes;  // capacity of each data region
  unsigned long long spin_timeout_ns;  // 0: wait for peers forever
};

// ---------------------------------------------------------------- memory ops

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Block b of this rank meets block b of every other rank.
template <int NR>
__device__ __forceinline__ void block_barrier(const Comm& c, uint32_t value) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < NR && t != c.rank) {
    __threadfence_system();
    st_release_sys(c.peers.flags[t] + blockIdx.x * KC_MAX_RANKS + c.rank, value);
    const uint32_t* mine = c.peers.flags[c.rank] + blockIdx.x * KC_MAX_RANKS + t;
    unsigned long long t0 = 0;
    while (ld_acquire_sys(mine) < value) {
      if (c.spin_timeout_ns) {
        const unsigned long long now = globaltimer_ns();
        if (t0 == 0) {
          t0 = now;
        } else if (now - t0 > c.spin_timeout_ns) {
          printf("kareus collectives: rank %d block %d waited more than %llu ns for rank %d "
                 "(barrier value %u, flag %u); ranks issued different collectives or a peer died\n",
                 c.rank, blockIdx.x, c.spin_timeout_ns, t, value, ld_acquire_sys(mine));
          __trap();
        }
      }
    }
  }
  __syncthreads();
}

// A "unit" is what one thread moves at a time: 16 bytes (VEC) or one element.
template <typename T, bool VEC>
struct Unit;

template <typename T>
struct Unit<T, true> {
  using type = uint4;
  static constexpr int N = 16 / sizeof(T);
};

template <typename T>
struct Unit<T, false> {
  using type = T;
  static constexpr int N = 1;
};

template <typename T>
__device__ __forceinline__ float to_f32(T x);
template <>
__device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T, typename U>
__device__ __forceinline__ void acc_add(float (&acc)[sizeof(U) / sizeof(T)], const U& u) {
  union {
    U u;
    T e[sizeof(U) / sizeof(T)];
  } x;
  x.u = u;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(U) / sizeof(T)); ++i) acc[i] += to_f32<T>(x.e[i]);
}

template <typename T, typename U>
__device__ __forceinline__ void acc_set(float (&acc)[sizeof(U) / sizeof(T)], const U& u) {
  union {
    U u;
    T e[sizeof(U) / sizeof(T)];
  } x;
  x.u = u;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(U) / sizeof(T)); ++i) acc[i] = to_f32<T>(x.e[i]);
}

template <typename T, typename U>
__device__ __forceinline__ U acc_pack(const float (&acc)[sizeof(U) / sizeof(T)]) {
  union {
    U u;
    T e[sizeof(U) / sizeof(T)];
  } x;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(U) / sizeof(T)); ++i) x.e[i] = from_f32<T>(acc[i]);
  return x.u;
}

// Loads of data that peers wrote into this rank's data region bypass L1.
template <typename U>
__device__ __forceinline__ U ld_cg(const U* p) { return __ldcg(p); }

// Units [0, n) are split among blocks as (i / KC_THREADS) % gridDim.x == blockIdx.x,
// the same split on every rank and in every phase. `load(k, i)` runs for UNR owned
// units before `store(k, i)` runs for them, so UNR loads are in flight per thread.
template <int UNR, typename Load, typename Store>
__device__ __forceinline__ void for_owned(size_t n, Load&& load, Store&& store) {
  const size_t stride = (size_t)gridDim.x * KC_THREADS;
  for (size_t base = (size_t)blockIdx.x * KC_THREADS + threadIdx.x; base < n; base += stride * UNR) {
#pragma unroll
    for (int k = 0; k < UNR; ++k) {
      const size_t i = base + k * stride;
      if (i < n) load(k, i);
    }
#pragma unroll
    for (int k = 0; k < UNR; ++k) {
      const size_t i = base + k * stride;
      if (i < n) store(k, i);
    }
  }
}

// Unroll depth: kernels that hold one unit per peer per step use fewer steps for
// more peers, to stay in registers.
template <int NR>
struct Depth {
  static constexpr int ONE = 4;                                   // one unit per step
  static constexpr int PER_PEER = NR <= 2 ? 4 : (NR <= 4 ? 2 : 1);  // NR-1 units per step
};

// ------------------------------------------------------------ one-shot all-reduce
// Every rank pushes its whole input into slot `rank` of every peer's data region,
// then reduces all n slots (its own slot is its input) locally, in rank order.
// Data region: n slots of `slot_elems` elements (numel rounded up to 16 bytes).
// `in` may equal `out` (in place).
template <typename T, int NR>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allreduce_oneshot(Comm c, const T* in, T* out, size_t numel, size_t slot_elems) {
  using U = uint4;
  constexpr int V = 16 / sizeof(T);
  constexpr int D = Depth<NR>::ONE;
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t nvec = numel / V;
  const size_t tail = numel - nvec * V;
  const size_t slot_bytes = slot_elems * sizeof(T);
  const char* mine = c.peers.data[r];

  block_barrier<NR>(c, base + 1);

  {  // Phase 1: push the input into slot r of every peer.
    U v[D];
    for_owned<D>(
        nvec, [&](int k, size_t i) { v[k] = reinterpret_cast<const U*>(in)[i]; },
        [&](int k, size_t i) {
#pragma unroll
          for (int p = 0; p < NR; ++p) {
            if (p == r) continue;
            reinterpret_cast<U*>(c.peers.data[p] + (size_t)r * slot_bytes)[i] = v[k];
          }
        });
    if (blockIdx.x == 0 && threadIdx.x < tail) {
      const size_t e = nvec * V + threadIdx.x;
      const T x = in[e];
#pragma unroll
      for (int p = 0; p < NR; ++p) {
        if (p == r) continue;
        reinterpret_cast<T*>(c.peers.data[p] + (size_t)r * slot_bytes)[e] = x;
      }
    }
  }

  block_barrier<NR>(c, base + 2);

  {  // Phase 2: reduce all slots in rank order.
    float acc[D][V];
    for_owned<D>(
        nvec,
        [&](int k, size_t i) {
#pragma unroll
          for (int s = 0; s < NR; ++s) {
            const U u = (s == r) ? reinterpret_cast<const U*>(in)[i]
                                 : ld_cg(reinterpret_cast<const U*>(mine + (size_t)s * slot_bytes) + i);
            if (s == 0)
              acc_set<T, U>(acc[k], u);
            else
              acc_add<T, U>(acc[k], u);
          }
        },
        [&](int k, size_t i) { reinterpret_cast<U*>(out)[i] = acc_pack<T, U>(acc[k]); });
    if (blockIdx.x == 0 && threadIdx.x < tail) {
      const size_t e = nvec * V + threadIdx.x;
      float a = 0.f;
#pragma unroll
      for (int s = 0; s < NR; ++s) {
        const T x = (s == r) ? in[e] : ld_cg(reinterpret_cast<const T*>(mine + (size_t)s * slot_bytes) + e);
        a = (s == 0) ? to_f32<T>(x) : a + to_f32<T>(x);
      }
      out[e] = from_f32<T>(a);
    }
  }

  __syncthreads();
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

// ------------------------------------------------------ reduce-scatter push of a chunked all-reduce
// The first phase of the two-shot (staged) and two-phase (registered) all-reduces, which
// split the message into NR chunks of `chunk` elements (a multiple of the vector width),
// chunk q reduced by rank q: rank r stores its input chunk q (len[q] elements, the first
// lenv[q] x V of them as 16-byte vectors, the rest by block 0) into slot r of rank q's data
// region (slots `chunk` elements apart), for every peer q. Its own chunk stays in `in`.
// r (= c.rank) and chunk_vec (= chunk / V) are passed as the caller already holds them, so
// that both kernels' PTX is the instructions, in the order, it was when each wrote this
// phase itself; DP is the unroll depth of the vector loop (NR-1 vectors per thread a step).
template <typename T, int NR, int DP>
__device__ __forceinline__ void push_chunks_to_owners(const Comm& c, int r, const T* in,
                                                      size_t chunk, size_t chunk_vec,
                                                      const size_t (&len)[NR],
                                                      const size_t (&lenv)[NR]) {
  using U = uint4;
  constexpr int V = 16 / sizeof(T);
  const size_t chunk_bytes = chunk * sizeof(T);
  U v[DP][NR];
  for_owned<DP>(
      chunk_vec,
      [&](int k, size_t i) {
#pragma unroll
        for (int q = 0; q < NR; ++q) {
          if (q == r) continue;
          if (i < lenv[q]) v[k][q] = reinterpret_cast<const U*>(in + (size_t)q * chunk)[i];
        }
      },
      [&](int k, size_t i) {
#pragma unroll
        for (int q = 0; q < NR; ++q) {
          if (q == r) continue;
          if (i < lenv[q]) reinterpret_cast<U*>(c.peers.data[q] + (size_t)r * chunk_bytes)[i] = v[k][q];
        }
      });
  if (blockIdx.x == 0) {
#pragma unroll
    for (int q = 0; q < NR; ++q) {
      if (q == r) continue;
      if (threadIdx.x < len[q] - lenv[q] * V) {
        const size_t e = lenv[q] * V + threadIdx.x;
        reinterpret_cast<T*>(c.peers.data[q] + (size_t)r * chunk_bytes)[e] = in[(size_t)q * chunk + e];
      }
    }
  }
}

// ------------------------------------------------------------ two-shot all-reduce
// Reduce-scatter then all-gather, both by pushing. Chunk q = [q*chunk, min(numel,(q+1)*chunk))
// is reduced by rank q. Data region: n reduce-scatter slots of `chunk` elements, then
// n gather slots of `chunk` elements. `chunk` is a multiple of the vector width.
// `in` may equal `out` (in place).
template <typename T, int NR>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allreduce_twoshot(Comm c, const T* in, T* out, size_t numel, size_t chunk) {
  using U = uint4;
  constexpr int V = 16 / sizeof(T);
  constexpr int D1 = Depth<NR>::ONE;
  constexpr int DP = Depth<NR>::PER_PEER;
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t chunk_bytes = chunk * sizeof(T);
  const size_t chunk_vec = chunk / V;
  const char* mine = c.peers.data[r];

  // Elements and whole vectors in chunk q.
  size_t len[NR], lenv[NR];
#pragma unroll
  for (int q = 0; q < NR; ++q) {
    const size_t lo = (size_t)q * chunk;
    len[q] = lo >= numel ? 0 : (numel - lo < chunk ? numel - lo : chunk);
    lenv[q] = len[q] / V;
  }

  block_barrier<NR>(c, base + 1);

  // Phase 1: push input chunk q into reduce-scatter slot r of rank q.
  push_chunks_to_owners<T, NR, DP>(c, r, in, chunk, chunk_vec, len, lenv);

  block_barrier<NR>(c, base + 2);

  {  // Phase 2: reduce own chunk in rank order; store locally and into gather slot r of every peer.
    float acc[D1][V];
    size_t my_vec = 0, my_len = 0;
#pragma unroll
    for (int q = 0; q < NR; ++q)
      if (q == r) {
        my_vec = lenv[q];
        my_len = len[q];
      }
    for_owned<D1>(
        my_vec,
        [&](int k, size_t i) {
#pragma unroll
          for (int s = 0; s < NR; ++s) {
            const U u = (s == r) ? reinterpret_cast<const U*>(in + (size_t)r * chunk)[i]
                                 : ld_cg(reinterpret_cast<const U*>(mine + (size_t)s * chunk_bytes) + i);
            if (s == 0)
              acc_set<T, U>(acc[k], u);
            else
              acc_add<T, U>(acc[k], u);
          }
        },
        [&](int k, size_t i) {
          const U res = acc_pack<T, U>(acc[k]);
          reinterpret_cast<U*>(out + (size_t)r * chunk)[i] = res;
#pragma unroll
          for (int p = 0; p < NR; ++p) {
            if (p == r) continue;
            reinterpret_cast<U*>(c.peers.data[p] + (size_t)(NR + r) * chunk_bytes)[i] = res;
          }
        });
    if (blockIdx.x == 0 && threadIdx.x < my_len - my_vec * V) {
      const size_t e = my_vec * V + threadIdx.x;
      float a = 0.f;
#pragma unroll
      for (int s = 0; s < NR; ++s) {
        const T x = (s == r) ? in[(size_t)r * chunk + e]
                             : ld_cg(reinterpret_cast<const T*>(mine + (size_t)s * chunk_bytes) + e);
        a = (s == 0) ? to_f32<T>(x) : a + to_f32<T>(x);
      }
      const T res = from_f32<T>(a);
      out[(size_t)r * chunk + e] = res;
#pragma unroll
      for (int p = 0; p < NR; ++p) {
        if (p == r) continue;
        reinterpret_cast<T*>(c.peers.data[p] + (size_t)(NR + r) * chunk_bytes)[e] = res;
      }
    }
  }

  block_barrier<NR>(c, base + 3);

  {  // Phase 3: copy the other ranks' reduced chunks from the gather slots to the output.
    U v[DP][NR];
    for_owned<DP>(
        chunk_vec,
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            if (i < lenv[q]) v[k][q] = ld_cg(reinterpret_cast<const U*>(mine + (size_t)(NR + q) * chunk_bytes) + i);
          }
        },
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            if (i < lenv[q]) reinterpret_cast<U*>(out + (size_t)q * chunk)[i] = v[k][q];
          }
        });
    if (blockIdx.x == 0) {
#pragma unroll
      for (int q = 0; q < NR; ++q) {
        if (q == r) continue;
        if (threadIdx.x < len[q] - lenv[q] * V) {
          const size_t e = lenv[q] * V + threadIdx.x;
          out[(size_t)q * chunk + e] = ld_cg(reinterpret_cast<const T*>(mine + (size_t)(NR + q) * chunk_bytes) + e);
        }
      }
    }
  }

  __syncthreads();
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 3;
}

// ------------------------------------------------------------------ all-gather
// in: m elements per rank; out: rank q's shard at [q*stride, q*stride + m) (stride >= m;
// stride > m when the host splits a large message into pieces).
// Data region: n slots of `slot` elements. VEC requires m % (16/sizeof(T)) == 0 and
// 16-byte aligned pointers (checked by the host).
template <typename T, int NR, bool VEC>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allgather(Comm c, const T* in, T* out, size_t m, size_t stride, size_t slot) {
  using U = typename Unit<T, VEC>::type;
  constexpr int V = Unit<T, VEC>::N;
  constexpr int D1 = Depth<NR>::ONE;
  constexpr int DP = Depth<NR>::PER_PEER;
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t nu = m / V;
  const size_t slot_bytes = slot * sizeof(T);
  const char* mine = c.peers.data[r];

  block_barrier<NR>(c, base + 1);
  {  // Phase 1: own shard to the output and into slot r of every peer.
    U v[D1];
    for_owned<D1>(
        nu, [&](int k, size_t i) { v[k] = reinterpret_cast<const U*>(in)[i]; },
        [&](int k, size_t i) {
          reinterpret_cast<U*>(out + (size_t)r * stride)[i] = v[k];
#pragma unroll
          for (int p = 0; p < NR; ++p) {
            if (p == r) continue;
            reinterpret_cast<U*>(c.peers.data[p] + (size_t)r * slot_bytes)[i] = v[k];
          }
        });
  }
  block_barrier<NR>(c, base + 2);
  {  // Phase 2: the other shards from the slots to the output.
    U v[DP][NR];
    for_owned<DP>(
        nu,
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            v[k][q] = ld_cg(reinterpret_cast<const U*>(mine + (size_t)q * slot_bytes) + i);
          }
        },
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            reinterpret_cast<U*>(out + (size_t)q * stride)[i] = v[k][q];
          }
        });
  }
  __syncthreads();
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

// -------------------------------------------------------------- reduce-scatter
// in: block q at [q*stride, q*stride + m); out: m elements = sum over ranks q (in rank
// order) of rank q's block r. Data region: n slots of `slot` elements.
template <typename T, int NR, bool VEC>
__global__ void __launch_bounds__(KC_THREADS, 1)
    reducescatter(Comm c, const T* in, T* out, size_t m, size_t stride, size_t slot) {
  using U = typename Unit<T, VEC>::type;
  constexpr int V = Unit<T, VEC>::N;
  constexpr int D1 = Depth<NR>::ONE;
  constexpr int DP = Depth<NR>::PER_PEER;
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t nu = m / V;
  const size_t slot_bytes = slot * sizeof(T);
  const char* mine = c.peers.data[r];

  block_barrier<NR>(c, base + 1);
  {  // Phase 1: input block q into slot r of rank q.
    U v[DP][NR];
    for_owned<DP>(
        nu,
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            v[k][q] = reinterpret_cast<const U*>(in + (size_t)q * stride)[i];
          }
        },
        [&](int k, size_t i) {
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            if (q == r) continue;
            reinterpret_cast<U*>(c.peers.data[q] + (size_t)r * slot_bytes)[i] = v[k][q];
          }
        });
  }
  block_barrier<NR>(c, base + 2);
  {  // Phase 2: reduce in rank order.
    float acc[D1][sizeof(U) / sizeof(T)];
    for_owned<D1>(
        nu,
        [&](int k, size_t i) {
#pragma unroll
          for (int s = 0; s < NR; ++s) {
            const U u = (s == r) ? reinterpret_cast<const U*>(in + (size_t)r * stride)[i]
                                 : ld_cg(reinterpret_cast<const U*>(mine + (size_t)s * slot_bytes) + i);
            if (s == 0)
              acc_set<T, U>(acc[k], u);
            else
              acc_add<T, U>(acc[k], u);
          }
        },
        [&](int k, size_t i) { reinterpret_cast<U*>(out)[i] = acc_pack<T, U>(acc[k]); });
  }
  __syncthreads();
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

// Unroll depth of a loop whose step loads `loads` units per owned index: as many
// steps as keep about KC_INFLIGHT 16-byte loads in flight per thread (a power of two,
// 1..8). Memory latency, not bandwidth, limits one SM, so loads in flight set speed.
__host__ __device__ constexpr int depth_for(int loads) {
  return KC_INFLIGHT / loads >= 8 ? 8 : (KC_INFLIGHT / loads >= 4 ? 4 : (KC_INFLIGHT / loads >= 2 ? 2 : 1));
}

// Reduces every owned unit i < n over the NR sources src(s) + i in rank order (fp32
// accumulation) and hands the packed result to store(i, u). All NR loads of a step's
// units are issued before the first add.
template <typename T, typename U, int NR, typename Src, typename Store>
__device__ __forceinline__ void reduce_owned(size_t n, Src&& src, Store&& store) {
  constexpr int DR = depth_for(NR);
  U raw[DR][NR];
  for_owned<DR>(
      n,
      [&](int k, size_t i) {
#pragma unroll
        for (int s = 0; s < NR; ++s) raw[k][s] = ld_cg(src(s) + i);
      },
      [&](int k, size_t i) {
        float acc[sizeof(U) / sizeof(T)];
        acc_set<T, U>(acc, raw[k][0]);
#pragma unroll
        for (int s = 1; s < NR; ++s) acc_add<T, U>(acc, raw[k][s]);
        store(i, acc_pack<T, U>(acc));
      });
}

// Pointers to one buffer of every rank (a registered tensor), as mapped here.
struct Ptrs {
  char* p[KC_MAX_RANKS];
};

// ====================================================== registered-buffer kernels
// These run on tensors that every rank allocated through the communicator (mapped by
// every peer), so results are stored straight into the peers' tensors and no staging
// copy is needed. Element ownership and barriers are as above; every kernel ends
// with a barrier so that a rank's tensor is complete when its kernel finishes.

// All-reduce in place, one phase: rank r reads chunk r of every rank's tensor (peers
// over NVLink), reduces in rank order and stores the result into chunk r of every
// rank's tensor. Per rank: reads S, writes S.
template <typename T, int NR>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allreduce_reg_onephase(Comm c, Ptrs buf, size_t numel, size_t chunk) {
  using U = uint4;
  constexpr int V = 16 / sizeof(T);
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t lo = (size_t)r * chunk;
  const size_t my_len = lo >= numel ? 0 : (numel - lo < chunk ? numel - lo : chunk);
  const size_t my_vec = my_len / V;
  const size_t off = lo * sizeof(T);

  block_barrier<NR>(c, base + 1);
  {
    reduce_owned<T, U, NR>(
        my_vec,
        [&](int s) -> const U* { return reinterpret_cast<const U*>(buf.p[s] + off); },
        [&](size_t i, const U& res) {
#pragma unroll
          for (int p = 0; p < NR; ++p) reinterpret_cast<U*>(buf.p[p] + off)[i] = res;
        });
    if (blockIdx.x == 0 && threadIdx.x < my_len - my_vec * V) {
      const size_t e = my_vec * V + threadIdx.x;
      float a = 0.f;
#pragma unroll
      for (int s = 0; s < NR; ++s) {
        const T x = ld_cg(reinterpret_cast<const T*>(buf.p[s] + off) + e);
        a = (s == 0) ? to_f32<T>(x) : a + to_f32<T>(x);
      }
      const T res = from_f32<T>(a);
#pragma unroll
      for (int p = 0; p < NR; ++p) reinterpret_cast<T*>(buf.p[p] + off)[e] = res;
    }
  }
  block_barrier<NR>(c, base + 2);
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

// All-reduce in place, two phases, stores only: rank r pushes chunk q of its tensor
// into slot r of rank q's staging; then rank q reduces its slots (own chunk read from
// its tensor) and stores the result into chunk q of every rank's tensor. Per rank:
// reads 1.75 S, writes 1.75 S (n = 4), no remote loads.
template <typename T, int NR>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allreduce_reg_twophase(Comm c, Ptrs buf, size_t numel, size_t chunk) {
  using U = uint4;
  constexpr int V = 16 / sizeof(T);
  constexpr int DP = depth_for(NR - 1);
  const uint32_t base = c.counters[blockIdx.x];
  const int r = c.rank;
  const size_t chunk_bytes = chunk * sizeof(T);
  const size_t chunk_vec = chunk / V;
  const char* mine = c.peers.data[r];
  const T* in = reinterpret_cast<const T*>(buf.p[r]);
  size_t len[NR], lenv[NR];
#pragma unroll
  for (int q = 0; q < NR; ++q) {
    const size_t lo = (size_t)q * chunk;
    len[q] = lo >= numel ? 0 : (numel - lo < chunk ? numel - lo : chunk);
    lenv[q] = len[q] / V;
  }

  block_barrier<NR>(c, base + 1);
  push_chunks_to_owners<T, NR, DP>(c, r, in, chunk, chunk_vec, len, lenv);
  block_barrier<NR>(c, base + 2);
  {
    size_t my_vec = 0, my_len = 0;
#pragma unroll
    for (int q = 0; q < NR; ++q)
      if (q == r) {
        my_vec = lenv[q];
        my_len = len[q];
      }
    const size_t off = (size_t)r * chunk_bytes;
    reduce_owned<T, U, NR>(
        my_vec,
        [&](int s) -> const U* { return s == r ? reinterpret_cast<const U*>(in + (size_t)r * chunk) : reinterpret_cast<const U*>(mine + (size_t)s * chunk_bytes); },
        [&](size_t i, const U& res) {
#pragma unroll
          for (int p = 0; p < NR; ++p) reinterpret_cast<U*>(buf.p[p] + off)[i] = res;
        });
    if (blockIdx.x == 0 && threadIdx.x < my_len - my_vec * V) {
      const size_t e = my_vec * V + threadIdx.x;
      float a = 0.f;
#pragma unroll
      for (int s = 0; s < NR; ++s) {
        const T x = (s == r) ? in[(size_t)r * chunk + e]
                             : ld_cg(reinterpret_cast<const T*>(mine + (size_t)s * chunk_bytes) + e);
        a = (s == 0) ? to_f32<T>(x) : a + to_f32<T>(x);
      }
      const T res = from_f32<T>(a);
#pragma unroll
      for (int p = 0; p < NR; ++p) reinterpret_cast<T*>(buf.p[p] + off)[e] = res;
    }
  }
  block_barrier<NR>(c, base + 3);
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 3;
}

// All-gather into registered outputs: rank r stores its input straight into
// [r*stride, r*stride + m) of every rank's output. Per rank: reads m, writes n*m.
template <typename T, int NR, bool VEC>
__global__ void __launch_bounds__(KC_THREADS, 1)
    allgather_reg(Comm c, const T* in, Ptrs outs, size_t m, size_t stride) {
  using U = typename Unit<T, VEC>::type;
  constexpr int V = Unit<T, VEC>::N;
  constexpr int D1 = depth_for(1);
  const uint32_t base = c.counters[blockIdx.x];
  const size_t off = (size_t)c.rank * stride * sizeof(T);
  block_barrier<NR>(c, base + 1);
  {
    U v[D1];
    for_owned<D1>(
        m / V, [&](int k, size_t i) { v[k] = reinterpret_cast<const U*>(in)[i]; },
        [&](int k, size_t i) {
#pragma unroll
          for (int p = 0; p < NR; ++p) reinterpret_cast<U*>(outs.p[p] + off)[i] = v[k];
        });
  }
  block_barrier<NR>(c, base + 2);
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

// Reduce-scatter from registered inputs: rank r reads block r of every rank's input
// (peers over NVLink), reduces in rank order into its output. Per rank: reads n*m,
// writes m.
template <typename T, int NR, bool VEC>
__global__ void __launch_bounds__(KC_THREADS, 1)
    reducescatter_reg(Comm c, Ptrs ins, T* out, size_t m, size_t stride) {
  using U = typename Unit<T, VEC>::type;
  constexpr int V = Unit<T, VEC>::N;
  const uint32_t base = c.counters[blockIdx.x];
  const size_t off = (size_t)c.rank * stride * sizeof(T);
  block_barrier<NR>(c, base + 1);
  {
    reduce_owned<T, U, NR>(
        m / V, [&](int s) -> const U* { return reinterpret_cast<const U*>(ins.p[s] + off); },
        [&](size_t i, const U& res) { reinterpret_cast<U*>(out)[i] = res; });
  }
  block_barrier<NR>(c, base + 2);
  if (threadIdx.x == 0) c.counters[blockIdx.x] = base + 2;
}

}  // namespace kc

// ====================================================================== C ABI

namespace {

thread_local char g_err[512] = "";

int set_err(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    snprintf(g_err, sizeof(g_err), "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return (int)e;
  }
  return 0;
}

int set_msg(const char* msg) {
  snprintf(g_err, sizeof(g_err), "%s", msg);
  return -1;
}

enum DType { KC_BF16 = 0, KC_FP16 = 1, KC_FP32 = 2 };

template <typename T, int NR>
int launch_allreduce(const kc::Comm& c, const void* in, void* out, size_t numel, int algo, int blocks,
                     cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  if (algo == 0) {
    const size_t slot = (numel + V - 1) / V * V;
    if ((size_t)NR * slot * sizeof(T) > c.data_bytes) return set_msg("one-shot all-reduce: message too large for staging");
    kc::allreduce_oneshot<T, NR><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, numel, slot);
  } else {
    size_t chunk = (numel + NR - 1) / NR;
    chunk = (chunk + V - 1) / V * V;
    if (chunk == 0) chunk = V;
    if (2 * (size_t)NR * chunk * sizeof(T) > c.data_bytes) return set_msg("two-shot all-reduce: message too large for staging");
    kc::allreduce_twoshot<T, NR><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, numel, chunk);
  }
  return set_err(cudaGetLastError(), "all-reduce launch");
}

template <typename T, int NR>
int launch_ag_rs(const kc::Comm& c, int op, const void* in, void* out, size_t m, size_t stride, int blocks,
                 cudaStream_t s) {
  if (stride < m) return set_msg("stride must be >= numel");
  constexpr int V = 16 / sizeof(T);
  const size_t slot = (m + V - 1) / V * V;
  if ((size_t)NR * slot * sizeof(T) > c.data_bytes) return set_msg("all-gather/reduce-scatter: message too large for staging");
  const bool vec = (m % V == 0) && (stride % V == 0) && ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  if (op == 1) {
    if (vec)
      kc::allgather<T, NR, true><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, m, stride, slot);
    else
      kc::allgather<T, NR, false><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, m, stride, slot);
  } else {
    if (vec)
      kc::reducescatter<T, NR, true><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, m, stride, slot);
    else
      kc::reducescatter<T, NR, false><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, (T*)out, m, stride, slot);
  }
  return set_err(cudaGetLastError(), op == 1 ? "all-gather launch" : "reduce-scatter launch");
}

template <typename T>
int dispatch_world(const kc::Comm& c, int op, const void* in, void* out, size_t n, size_t stride, int algo,
                   int blocks, cudaStream_t s) {
  switch (c.world) {
#define KC_CASE(NR)                                                  \
  case NR:                                                           \
    if (op == 0) return launch_allreduce<T, NR>(c, in, out, n, algo, blocks, s); \
    return launch_ag_rs<T, NR>(c, op, in, out, n, stride, blocks, s);
    KC_CASE(2)
    KC_CASE(4)
    KC_CASE(8)
#undef KC_CASE
    default:
      return set_msg("world size must be 2, 4 or 8");
  }
}

template <typename T, int NR>
int launch_registered(const kc::Comm& c, int op, const void* in, void* out, void* const* regs, size_t n,
                      size_t stride, int algo, int blocks, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  kc::Ptrs ptrs;
  memset(&ptrs, 0, sizeof(ptrs));
  for (int q = 0; q < NR; ++q) ptrs.p[q] = reinterpret_cast<char*>(regs[q]);
  bool aligned = true;
  for (int q = 0; q < NR; ++q) aligned = aligned && ((uintptr_t)regs[q] % 16 == 0);
  if (op == 0) {
    if (!aligned) return set_msg("registered all-reduce: tensor not 16-byte aligned");
    size_t chunk = (n + NR - 1) / NR;
    chunk = (chunk + V - 1) / V * V;
    if (chunk == 0) chunk = V;
    if (algo == 0) {
      kc::allreduce_reg_onephase<T, NR><<<blocks, KC_THREADS, 0, s>>>(c, ptrs, n, chunk);
    } else {
      if ((size_t)NR * chunk * sizeof(T) > c.data_bytes) return set_msg("two-phase all-reduce: message too large for staging");
      kc::allreduce_reg_twophase<T, NR><<<blocks, KC_THREADS, 0, s>>>(c, ptrs, n, chunk);
    }
    return set_err(cudaGetLastError(), "registered all-reduce launch");
  }
  if (stride < n) return set_msg("stride must be >= numel");
  const bool vec = aligned && (n % V == 0) && (stride % V == 0) && ((uintptr_t)in % 16 == 0) &&
                   ((uintptr_t)out % 16 == 0);
  if (op == 1) {
    if (vec)
      kc::allgather_reg<T, NR, true><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, ptrs, n, stride);
    else
      kc::allgather_reg<T, NR, false><<<blocks, KC_THREADS, 0, s>>>(c, (const T*)in, ptrs, n, stride);
  } else {
    if (vec)
      kc::reducescatter_reg<T, NR, true><<<blocks, KC_THREADS, 0, s>>>(c, ptrs, (T*)out, n, stride);
    else
      kc::reducescatter_reg<T, NR, false><<<blocks, KC_THREADS, 0, s>>>(c, ptrs, (T*)out, n, stride);
  }
  return set_err(cudaGetLastError(), op == 1 ? "registered all-gather launch" : "registered reduce-scatter launch");
}

template <typename T>
int dispatch_registered(const kc::Comm& c, int op, const void* in, void* out, void* const* regs, size_t n,
                        size_t stride, int algo, int blocks, cudaStream_t s) {
  switch (c.world) {
    case 2:
      return launch_registered<T, 2>(c, op, in, out, regs, n, stride, algo, blocks, s);
    case 4:
      return launch_registered<T, 4>(c, op, in, out, regs, n, stride, algo, blocks, s);
    case 8:
      return launch_registered<T, 8>(c, op, in, out, regs, n, stride, algo, blocks, s);
    default:
      return set_msg("world size must be 2, 4 or 8");
  }
}

}  // namespace

extern "C" {

int kc_api_version() { return KC_API_VERSION; }
int kc_max_blocks() { return KC_MAX_BLOCKS; }
int kc_max_ranks() { return KC_MAX_RANKS; }
int kc_threads_per_block() { return KC_THREADS; }
long long kc_data_offset() { return KC_DATA_OFFSET; }
const char* kc_last_error() { return g_err; }

int kc_sm_count(int device, int* out) {
  return set_err(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
}

int kc_can_access_peer(int a, int b, int* out) {
  return set_err(cudaDeviceCanAccessPeer(out, a, b), "cudaDeviceCanAccessPeer");
}

// Allocates a zeroed staging buffer of KC_DATA_OFFSET + data_bytes bytes on the
// current device and writes its IPC handle (cudaIpcMemHandle_t, 64 bytes) to handle_out.
int kc_staging_alloc(size_t data_bytes, void** ptr_out, void* handle_out) {
  void* p = nullptr;
  int rc = set_err(cudaMalloc(&p, KC_DATA_OFFSET + data_bytes), "cudaMalloc(staging)");
  if (rc) return rc;
  rc = set_err(cudaMemset(p, 0, KC_DATA_OFFSET + data_bytes), "cudaMemset(staging)");
  if (!rc) rc = set_err(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (!rc && handle_out) {
    cudaIpcMemHandle_t h;
    rc = set_err(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    if (!rc) memcpy(handle_out, &h, sizeof(h));
  }
  if (rc) {
    cudaFree(p);
    return rc;
  }
  *ptr_out = p;
  return 0;
}

int kc_ipc_handle_bytes() { return (int)sizeof(cudaIpcMemHandle_t); }

int kc_ipc_open(const void* handle, void** ptr_out) {
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  return set_err(cudaIpcOpenMemHandle(ptr_out, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
}

int kc_ipc_close(void* ptr) { return set_err(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle"); }

int kc_free(void* ptr) { return set_err(cudaFree(ptr), "cudaFree"); }

// Creates a communicator. bases[q] is rank q's staging allocation as mapped in this
// process (base, not data region). Returns an opaque host pointer.
int kc_comm_create(int rank, int world, void* const* bases, size_t data_bytes,
                   unsigned long long spin_timeout_ns, void** comm_out) {
  if (world != 2 && world != 4 && world != 8) return set_msg("world size must be 2, 4 or 8");
  if (rank < 0 || rank >= world) return set_msg("rank out of range");
  kc::Comm* c = new kc::Comm();
  memset(c, 0, sizeof(*c));
  for (int q = 0; q < world; ++q) {
    c->peers.flags[q] = reinterpret_cast<uint32_t*>(bases[q]);
    c->peers.data[q] = reinterpret_cast<char*>(bases[q]) + KC_DATA_OFFSET;
  }
  c->rank = rank;
  c->world = world;
  c->data_bytes = data_bytes;
  c->spin_timeout_ns = spin_timeout_ns;
  int rc = set_err(cudaMalloc(&c->counters, KC_MAX_BLOCKS * sizeof(uint32_t)), "cudaMalloc(counters)");
  if (!rc) rc = set_err(cudaMemset(c->counters, 0, KC_MAX_BLOCKS * sizeof(uint32_t)), "cudaMemset(counters)");
  if (!rc) rc = set_err(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (rc) {
    if (c->counters) cudaFree(c->counters);
    delete c;
    return rc;
  }
  *comm_out = c;
  return 0;
}

int kc_comm_destroy(void* comm) {
  kc::Comm* c = reinterpret_cast<kc::Comm*>(comm);
  if (!c) return 0;
  int rc = set_err(cudaFree(c->counters), "cudaFree(counters)");
  delete c;
  return rc;
}

// op: 0 all-reduce (numel = elements of in/out; algo 0 one-shot, 1 two-shot; stride unused),
//     1 all-gather (numel = elements per rank; output shard q at out + q*stride),
//     2 reduce-scatter (numel = output elements; input block q at in + q*stride).
// dtype: 0 bf16, 1 fp16, 2 fp32. blocks: grid size = number of SMs used.
int kc_run(void* comm, int op, int dtype, const void* in, void* out, size_t numel, size_t stride, int algo,
           int blocks, void* stream) {
  const kc::Comm* c = reinterpret_cast<const kc::Comm*>(comm);
  if (!c) return set_msg("null communicator");
  if (blocks < 1 || blocks > KC_MAX_BLOCKS) return set_msg("blocks out of range");
  if (op < 0 || op > 2) return set_msg("unknown op");
  if (numel == 0) return 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case KC_BF16:
      return dispatch_world<__nv_bfloat16>(*c, op, in, out, numel, stride, algo, blocks, s);
    case KC_FP16:
      return dispatch_world<__half>(*c, op, in, out, numel, stride, algo, blocks, s);
    case KC_FP32:
      return dispatch_world<float>(*c, op, in, out, numel, stride, algo, blocks, s);
    default:
      return set_msg("unknown dtype");
  }
}

// Registered-buffer variant. regs[q] is rank q's registered tensor as mapped here:
// op 0 all-reduce in place on regs (algo 0 one-phase, 1 two-phase; in/out unused),
// op 1 all-gather of local `in` into the registered outputs regs (shard q at q*stride),
// op 2 reduce-scatter of the registered inputs regs (block q at q*stride) into local `out`.
int kc_run_registered(void* comm, int op, int dtype, const void* in, void* out, void* const* regs,
                      size_t numel, size_t stride, int algo, int blocks, void* stream) {
  const kc::Comm* c = reinterpret_cast<const kc::Comm*>(comm);
  if (!c) return set_msg("null communicator");
  if (blocks < 1 || blocks > KC_MAX_BLOCKS) return set_msg("blocks out of range");
  if (op < 0 || op > 2) return set_msg("unknown op");
  if (numel == 0) return 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case KC_BF16:
      return dispatch_registered<__nv_bfloat16>(*c, op, in, out, regs, numel, stride, algo, blocks, s);
    case KC_FP16:
      return dispatch_registered<__half>(*c, op, in, out, regs, numel, stride, algo, blocks, s);
    case KC_FP32:
      return dispatch_registered<float>(*c, op, in, out, regs, numel, stride, algo, blocks, s);
    default:
      return set_msg("unknown dtype");
  }
}

}  // extern "C"
