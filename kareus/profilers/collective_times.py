"""How long a real collective takes: the times the time-faithful one-GPU stand-in holds.

[`EmulatedCollectiveTimes`][kareus.profilers.collective_times.EmulatedCollectiveTimes] is
the default [`CollectiveTimes`][kareus.exec.train.CollectiveTimes]: the emulated GPU's
collective time (``EmulatedGPU.comm_time_s``: a fixed latency plus the bus bytes over the
smaller of SMs x a per-SM rate and a link limit, at the GPU's maximum clock), without the
kernel launch (the stand-in's own launch is real). Its curves are, in order of preference:

1. fitted to the collectives measured on 2 and 4 GPUs of a GPU profile kareus ships
   (``kareus/model/profiles/``: the H200's, both kareus's own kernels and capped NCCL),
   where the profile has the collective's kind at the group's size: **measured**;
2. otherwise the emulator's link model (the nearest measured group size of that kind,
   or the preset's curves scaled to its clock and NVLink): **modelled**.

Each time says which ([`source`][kareus.profilers.collective_times.EmulatedCollectiveTimes.source]),
and the stand-in's note carries it into every output.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError
from kareus.exec.train import CollectiveTimes
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.gpu_profile import GPUProfile, shipped_profiles
from kareus.model.ops import CommOp
from kareus.profilers.emulator import EmulatedGPU

__all__ = ["EmulatedCollectiveTimes"]


class EmulatedCollectiveTimes(CollectiveTimes):
    """Collective times from the measured collective curves of a GPU profile, or the
    emulator's link model where there is none.

    Args:
        gpu: A GPU preset name or [`GPUSpec`][kareus.model.GPUSpec].
        profile: A ``GPUProfile`` (or a profile file's path) whose measured collectives to
            fit; ``None``: the one kareus ships for ``gpu``, if any; ``False``: none (the
            link model only).
        freq_mhz: The clock the times are for (``None``: the GPU's maximum; ``kareus
            verify`` never changes clocks).
    """

    def __init__(self, gpu: str | GPUSpec, *, profile: Any = None,
                 freq_mhz: float | None = None) -> None:
        self.spec = get_gpu(gpu)
        if profile is None:
            profile = (GPUProfile.preset(self.spec.name) if self.spec.name in shipped_profiles()
                       else False)
        elif profile is not False and not isinstance(profile, GPUProfile):
            profile = GPUProfile.load(str(profile))
        self.profile: GPUProfile | None = profile or None
        self.freq_mhz = float(self.spec.max_clock_mhz if freq_mhz is None else freq_mhz)
        if self.freq_mhz <= 0:
            raise ArgumentError(f"freq_mhz must be > 0, got {freq_mhz}")
        self._gpus: dict[str, EmulatedGPU] = {}

    def gpu(self, backend: str) -> EmulatedGPU:
        """The emulated GPU whose curves are ``backend``'s (``"nccl"`` or ``"own"``)."""
        if backend not in ("nccl", "own"):
            raise ArgumentError(f"backend must be 'nccl' or 'own', got {backend!r}")
        g = self._gpus.get(backend)
        if g is None:
            g = (EmulatedGPU.from_profile(self.profile, comm_backend=backend)
                 if self.profile is not None else
                 EmulatedGPU.from_spec(self.spec, comm_backend=backend))
            self._gpus[backend] = g
        return g

    def sms_for(self, sms: int | None) -> int:
        """An uncapped collective takes the GPU's ``default_comm_sms`` (NCCL's own CTAs)."""
        return self.spec.default_comm_sms if sms is None else int(sms)

    def time_s(self, kind: str, message_bytes: int, group_size: int, sms: int | None, *,
               backend: str) -> float:
        """The collective alone on ``sms`` SMs at ``freq_mhz``, its launch left out."""
        g = self.gpu(backend)
        op = CommOp(name="stand_in", kind=kind, bytes=float(message_bytes),
                    group_size=int(group_size))
        return max(0.0, g.comm_time_s(op, self.sms_for(sms), self.freq_mhz)
                   - g.launch_overhead_s)

    def measured(self, kind: str, group_size: int, *, backend: str) -> bool:
        """Whether a curve measured at this kind and group size gives the time."""
        return self.profile is not None and any(
            c.kind == kind and c.group_size == int(group_size)
            for c in self.gpu(backend).comm_curves)

    def source(self, kind: str, group_size: int, *, backend: str) -> str:
        """Measured or modelled, and from what."""
        g = int(group_size)
        if self.measured(kind, g, backend=backend):
            assert self.profile is not None
            return (f"{kind} over {g}: MEASURED curve ({backend} kernels, collectives "
                    f"measured on {g}x {self.profile.gpu} in kareus's GPU profile "
                    f"{self.profile.digest[:12]}, fitted per SM and link limit)")
        curves = self.gpu(backend).comm_curves
        same = sorted({c.group_size for c in curves if c.kind == kind})
        why = (f"nearest measured group of {min(same, key=lambda s: (abs(s - g), -s))}"
               if same else "the preset's per-SM rate and link limit")
        return f"{kind} over {g}: the emulator's link model ({backend} kernels; {why})"

    def describe(self) -> str:
        """One line: the GPU, clock and profile."""
        prof = (f"profile {self.profile.gpu} {self.profile.digest[:12]}"
                if self.profile is not None else "no measured profile")
        return f"{self.spec.name} at {self.freq_mhz:.0f} MHz ({prof})"
