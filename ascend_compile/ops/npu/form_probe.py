"""Whether this device's FIA takes a layer's form, asked of the device itself: one real call per process,
device and distinct form, at compile time (`passes/npu_checks.py`), as `ops/npu/band_probe.py` asks its band.

Where CANN versions differ, no rule here can say what a device takes. Every FIA call of the project is TND,
paged, without rope and of a head dim other than 512; in hicann/ops-transformer at c29bc106 such a call
always takes the PFA tiling (`fused_infer_attention_score_tiling.cpp` L700-716), which takes bfloat16 only
(`prompt_flash_attention_tiling.cpp` L3813-3816), a head dim of 64 or 128, or 192 where each query head has
its own KV head (L3800-3807), 64 or 128 with `learnable_sink` (L3669-3671) and in band mode (L4919-4921); a
later source (the mirror at bfbbec83, 2025-12) routes calls without sinks of sparse mode 0 or 3, several
query heads per KV head and blocks of 128 to a SplitFuse path taking float16 and bfloat16 and D <= 256
(`fused_infer_attention_score_tiling.cpp` L1181-1229, L975-977, L1035-1038), and every other to the same PFA
rules. So a float16 model, or a head dim of 96, is served on one device and refused by another; the docs'
general lists (`_op_plugin_docs.py` L8204-8210, the BSH/BSND/BNSD constraints) allow both, and TND's own list
(L8193-8197; v2 L8730, L8733) agrees with the older source only. What holds on every version read is a
compile-time rule (`npu_rules.check_fia_heads`: D <= 256; `check_attention_dtype`: no float32).

The form is what those paths branch on: query heads, KV heads, head dim, dtype, block size, and whether the
layer is windowed (band mode, sparse 4) or has sinks (FIA v2's `learnable_sink`). The call is the layer's
own kind, once at one query token (a decode step's call) and once at two (a mixed step's), on a one-block
cache: its workspace query, then the kernel; a windowed layer's at one query token without the band (its band
there is the S=1 band probe's question, `ops/npu/band_probe.py`: a refused call read as the band not applied, and
such calls then made without it). A RuntimeError (an aclnn error: the kernel's tiling refused the
form) is the answer: the layer is refused at compile time naming it and the device's message, instead of
failing at its first capture or warm-up with no eager fallback. The answers are kept in the persisted plan
(`plan_cache.py`): a warm start calls no probe.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ... import plan_cache
from . import band_probe as npu_band_probe
from ..tiling import AttentionShape

log = logging.getLogger("ascend_compile")

#: A layer's FIA form: (query heads, KV heads, head dim, dtype, block size, windowed, sinks).
Form = tuple[int, int, int, torch.dtype, int, bool, bool]

#: The answers (None: taken; else the device's message), per torch_npu module (a process has one; each fake a
#: test installs is another), then per (device, form).
_ANSWERS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, Form], str | None]]" = weakref.WeakKeyDictionary()


def form_of(shape: AttentionShape, dtype: torch.dtype, window: int | None, sinks: bool) -> Form:
    """The form of a FIA layer of `shape` and `dtype`, windowed or not, with sinks or not."""
    return (shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype, shape.block_size, window is not None,
            bool(sinks))


def refusal(kernels: Any, shape: AttentionShape, dtype: torch.dtype, window: int | None, sinks: bool) -> str | None:
    """Why this device's FIA does not take a layer of this form (its message), or None where it does: asked
    once per process, device and form (`kernels`: an `ops.npu.NpuKernels`)."""
    answers = _ANSWERS.setdefault(kernels.torch_npu, {})
    key = (str(kernels.device), form_of(shape, dtype, window, sinks))
    if key not in answers:
        answers[key] = _ask(kernels, shape, dtype, window is not None, sinks)
        log.info("ascend_compile: the FIA form probe (heads %d, KV heads %d, head dim %d, %s, blocks of %d%s%s): %s",
                 shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype, shape.block_size,
                 ", windowed" if window is not None else "", ", sinks" if sinks else "",
                 "taken" if answers[key] is None else f"refused: {answers[key]}")
    return answers[key]


@plan_cache.remembered("npu_probes", question=lambda kernels, shape, dtype, windowed, sinks: (
    "form", shape.num_heads, shape.num_kv_heads, shape.head_dim, str(dtype), shape.block_size, windowed, sinks))
def _ask(kernels: Any, shape: AttentionShape, dtype: torch.dtype, windowed: bool, sinks: bool) -> str | None:
    """One decode and one mixed call of the layer's form on the device; the device's message where it refuses."""
    device = kernels.device
    cache = torch.zeros(1, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    sink = torch.zeros(shape.num_heads, dtype=torch.bfloat16, device=device) if sinks else None
    # band mode of the band probes' pre_tokens (any band would do: whether the form takes sparse 4 at all), at two
    # query tokens: a windowed layer's S=1 calls take the band only where the S=1 band probe found it applied, whose
    # own call is that form's question (a refused one read as "not applied", `band_probe.band_at_single_query`), and
    # are made without it otherwise (`NpuKernels.fused_infer_attention`): here its S=1 call is the band-less one
    pre = npu_band_probe.PROBE_WINDOW - 1 if windowed else None
    for tokens in (1, 2):
        query = torch.zeros(tokens, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
        out = torch.empty_like(query)
        band = pre if tokens > 1 else None
        try:
            nbytes = kernels.band_workspace_nbytes(query, cache, cache, table, [tokens], [tokens], 1.0, out, band, sink)
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
            kernels.launch_fia(query, cache, cache, table, [tokens], [tokens], 1.0, workspace, out, band, sink)
        except RuntimeError as err:
            return f"the device's FIA refused a call of this layer's form at {tokens} query token(s): {err}"
    return None
