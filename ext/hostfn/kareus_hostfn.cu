// Stream-ordered trigger for kareus's frequency controller.
//
// kareus_hostfn_enqueue() enqueues a host function on a CUDA stream. When the GPU
// reaches that point of the stream, the CUDA driver's callback thread runs
// kareus_hostfn_fire(), which only writes the request's 8-byte token into a pipe
// (one write() of fewer than PIPE_BUF bytes is atomic) and frees its argument. It
// makes no CUDA or NVML call, as CUDA requires of host functions: the controller's
// own thread reads the pipe and changes the clock.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

namespace {

struct KareusHostRequest {
  int fd;
  uint64_t token;
};

void CUDART_CB kareus_hostfn_fire(void* arg) {
  KareusHostRequest* req = static_cast<KareusHostRequest*>(arg);
  ssize_t written = write(req->fd, &req->token, sizeof(req->token));
  (void)written;  // nothing safe to do about a closed pipe here
  free(req);
}

// The same write, for a request that fires again at each replay of a graph: the
// argument stays (kareus_hostfn_enqueue_standing).
void CUDART_CB kareus_hostfn_fire_standing(void* arg) {
  KareusHostRequest* req = static_cast<KareusHostRequest*>(arg);
  ssize_t written = write(req->fd, &req->token, sizeof(req->token));
  (void)written;
}

}  // namespace

extern "C" {

// Returns 0 on success, -1 when out of memory, else the cudaError_t value.
int kareus_hostfn_enqueue(void* stream, int fd, unsigned long long token) {
  KareusHostRequest* req =
      static_cast<KareusHostRequest*>(malloc(sizeof(KareusHostRequest)));
  if (req == nullptr) return -1;
  req->fd = fd;
  req->token = static_cast<uint64_t>(token);
  cudaError_t err =
      cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), kareus_hostfn_fire, req);
  if (err != cudaSuccess) {
    free(req);
    return static_cast<int>(err);
  }
  return 0;
}

// A standing marker, for CUDA-graph capture: under capture the host function becomes a
// host node that fires at every replay of the graph, so its argument must outlive every
// replay and is never freed (16 bytes per captured clock request, for the life of the
// process: a graph may be replayed until the process ends).
int kareus_hostfn_enqueue_standing(void* stream, int fd, unsigned long long token) {
  KareusHostRequest* req =
      static_cast<KareusHostRequest*>(malloc(sizeof(KareusHostRequest)));
  if (req == nullptr) return -1;
  req->fd = fd;
  req->token = static_cast<uint64_t>(token);
  cudaError_t err = cudaLaunchHostFunc(static_cast<cudaStream_t>(stream),
                                       kareus_hostfn_fire_standing, req);
  if (err != cudaSuccess) {
    free(req);
    return static_cast<int>(err);
  }
  return 0;
}

// ABI version of this library, checked by the Python side.
int kareus_hostfn_version(void) { return 2; }

}  // extern "C"
