"""Which attention kernel serves a batch: PA (decode-only, fast at small batch) or FIA (general);
a latent-attention (MLA) layer has one kernel, MLA, in every bucket.

One policy for every caller: `select_kernels` asks it per bucket at compile time, and the eager
`ascend.attention` op asks it per call with the default policy, so the threshold lives here only.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from . import tiling
from .features import PLAIN, AttentionFeatures

#: The default largest decode batch PA serves (an Ascend heuristic: PA wins at small batch).
PA_MAX_BATCH = 16

#: Times one call of (kernel, shape, batch) on the target device, in seconds.
KernelTimer = Callable[[str, tiling.AttentionShape, int], float]


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How a batch's kernel is chosen (see `CompileConfig.kernel_policy`)."""

    kind: str = "pa_max_batch"
    pa_max_batch: int = PA_MAX_BATCH
    pa_batch_sizes: tuple[int, ...] = ()
    timer: KernelTimer | None = None
    timing_seq_len: int = 1024
    why_pa: str = "kernel_policy='pa'"  # the reason recorded when kind is "pa" (a target may set its own)

    def __post_init__(self) -> None:
        if self.kind == "auto" and self.timer is None:
            raise ValueError("timer: the 'auto' kernel policy needs a timer to measure both kernels")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel of one attention call for one batch size, and why."""

    kernel: str
    reason: str
    times_ms: dict[str, float] | None = None


def choose_kernel(policy: KernelPolicy, batch: int, decode: bool, shape: tiling.AttentionShape,
                  features: AttentionFeatures = PLAIN) -> KernelChoice:
    """The kernel `policy` picks for `batch` query tokens (decode: one token per sequence) of a
    layer with `features`: FIA in every bucket for a layer with a feature PA lacks, MLA for an MLA
    layer (its shape has a rope part)."""
    pa, fia = tiling.PA, tiling.FIA
    if shape.latent:
        return KernelChoice(tiling.MLA, "MLA: a latent-attention layer; its one kernel (FIA v2's query_rope/key_rope "
                                        "form) serves decode and mixed steps in every bucket")
    if not features.plain:
        return KernelChoice(fia, f"FIA: the layer has {', '.join(features.names())}, which PA does not take")
    if not decode:
        return KernelChoice(fia, "FIA: steps with several query tokens per sequence; PA is decode-only")
    if policy.kind == "pa":
        return KernelChoice(pa, f"PA: {policy.why_pa}")
    if policy.kind == "fia":
        return KernelChoice(fia, "FIA: kernel_policy='fia'")
    if policy.kind == "pa_max_batch":
        if batch <= policy.pa_max_batch:
            return KernelChoice(pa, f"PA: bucket {batch} <= pa_max_batch {policy.pa_max_batch}")
        return KernelChoice(fia, f"FIA: bucket {batch} > pa_max_batch {policy.pa_max_batch}")
    if policy.kind == "pa_batch_sizes":
        if batch in policy.pa_batch_sizes:
            return KernelChoice(pa, f"PA: bucket {batch} in pa_batch_sizes {list(policy.pa_batch_sizes)}")
        return KernelChoice(fia, f"FIA: bucket {batch} not in pa_batch_sizes {list(policy.pa_batch_sizes)}")
    if policy.kind == "auto":
        times = {k: policy.timer(k, shape, batch) * 1e3 for k in (pa, fia)}
        best = min(times, key=times.get)
        label = "PA" if best == pa else "FIA"
        return KernelChoice(
            best,
            f"{label}: measured PA {times[pa]:.3f} ms vs FIA {times[fia]:.3f} ms "
            f"at batch {batch}, context {policy.timing_seq_len}",
            times,
        )
    raise ValueError(f"kernel_policy: unknown policy {policy.kind!r}")
