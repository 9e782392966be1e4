"""Whether FIA's band (`ops/npu_features.py`) applies to a call whose every sequence has one query token,
asked of the device itself: once per process, device and FIA form, at first use.

Lines `Lnnnn` are of torch_npu 2.14's `_op_plugin_docs.py`. A call whose query has S 1 is FIA's
IncreFlashAttention branch ("当Query矩阵的S为1, 进入IncreFlashAttention分支", L8056, v2 L8580); in TND that
is a call whose every sequence has one query token (the padding never gives one none: `passes/padding.py`),
every decode step. For that branch the docs say the band's arguments have no effect: `pre_tokens` and
`next_tokens` "Q_S为1时该参数无效" (L8110, L8111; v2 L8629, L8630), and `sparse_mode` too, "Q_S为1且不带rope输入时
该参数无效" (L8117, v2 L8635). vLLM-Ascend passes them in its decode graphs nevertheless
(`attention_v1.py` `full_graph_fia` L942, `full_graph_fia_v2` L1127, L1204), which holds only if the band
does apply there. The two readings differ exactly where a window matters, a decode step with a sequence
longer than its window, and a wrong reading would attend the whole context silently. So neither is
assumed: `band_at_single_query` runs one call of the real kernel (one sequence, one query token, KV
length 200 in 128-token blocks, a window of 16, random bfloat16 data whose values inside and outside the
window differ by 2) and compares it with the reference kernel (`ops/reference.py`) with and without the
window. It answers True only when the output is the windowed one; an output matching neither is
logged as a warning and read as False, the exact side.

Where the band does not apply at S 1, a decode step with a sequence longer than a windowed layer's window
runs eagerly, through the model's own attention (`passes/npu_checks.window_guard`), and the binding
refuses such a call (`REFUSAL`, `NpuKernels.fused_infer_attention`), so nothing computes it silently
wrong. Steps with a sequence of several query tokens (PromptFlashAttention, where the band's arguments
take effect) and decode steps whose sequences all fit their window (the band then cuts nothing) keep
their graphs. The other ways considered are not exact or not sound: giving FIA only the window's blocks
(a shifted block table) reads from the window's first *block*, exact only where the window starts at
a block's first key; an explicit mask at S 1 (sparse 0 with `(B, 1, Q_S, KV_S)`, L8077-8078; `(B, KV_S)`
only in BSH / BSND / BNSD, L8079), rebuilt on the device every step, at least `maxBlockNumPerSeq *
blockSize` wide with paged KV (L8226), is a second reading no device has checked in place of the first.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

import torch

from . import reference, tiling
from .features import AttentionFeatures

log = logging.getLogger("ascend_compile")

#: The probe's window, KV length, block size and tolerance (bfloat16 outputs of magnitude ~1).
PROBE_WINDOW, PROBE_KV_LEN, PROBE_BLOCK, PROBE_TOL = 16, 200, 128, 0.05

REFUSAL = ("torch_npu 2.14's docs say FIA's pre_tokens and next_tokens have no effect when every sequence has "
           "one query token ('Q_S为1时该参数无效', _op_plugin_docs.py L8110, L8111, L8629, L8630), and this device's "
           "probe found its band not applied there (ops/npu_band_probe.py)")

#: The answers, per torch_npu module (a process has one; each fake a test installs is another), then
#: per (device, FIA form: "v2-sinks" or "v1").
_ANSWERS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], bool]]" = weakref.WeakKeyDictionary()


def form(sinks: bool) -> str:
    """The FIA form a layer's calls take: v2 (`learnable_sink`) with sinks, v1 without."""
    return "v2-sinks" if sinks else "v1"


def single_query_outside(query_ends: Sequence[int], kv_lens: Sequence[int], window: int | None) -> bool:
    """Whether a call is FIA's S-1 branch (every sequence one query token: T == B, no sequence has none)
    with a sequence longer than `window`: the calls the two readings compute differently."""
    ends = [int(e) for e in query_ends]
    return window is not None and bool(ends) and ends[-1] == len(ends) and max(int(n) for n in kv_lens) > window


def known(kernels: Any) -> dict[str, bool]:
    """The answers asked so far on `kernels`' device, by form (for plan.json)."""
    answers = _ANSWERS.get(kernels.torch_npu, {})
    return {f: a for (device, f), a in answers.items() if device == str(kernels.device)}


def band_at_single_query(kernels: Any, sinks: bool) -> bool:
    """Whether FIA's band applies when every sequence has one query token, on `kernels`' device, in the
    form of a layer with or without `sinks`: the probe's answer, asked once and logged at INFO."""
    answers = _ANSWERS.setdefault(kernels.torch_npu, {})
    key = (str(kernels.device), form(sinks))
    if key not in answers:
        answers[key] = _probe(kernels, sinks)
        log.info("ascend_compile: FIA %s on %s %s the band (sparse_mode 4, pre_tokens) to a call whose every "
                 "sequence has one query token (the S=1 band probe): %s", key[1], key[0],
                 "applies" if answers[key] else "does not apply",
                 "windowed layers keep their decode graphs" if answers[key] else "decode steps with a sequence "
                 "longer than a layer's window run eagerly")
    return answers[key]


def _reference(query, key_cache, value_cache, table, scale, window, sinks) -> torch.Tensor:
    out = torch.empty_like(query)
    features = AttentionFeatures(window, None, sinks is not None)
    spans = [features.span(PROBE_KV_LEN, 1)]
    workspace = torch.empty(tiling.workspace_nbytes(tiling.FIA, tiling.AttentionShape.of(query, key_cache), spans,
                                                    [1]), dtype=torch.uint8)
    reference.fused_infer_attention(query, key_cache, value_cache, table, [1], [PROBE_KV_LEN], [1], scale, workspace,
                                    out, features, sinks)
    return out.float()


def _probe(kernels: Any, sinks: bool) -> bool:
    """One call of the device's FIA at S 1 against the reference with and without the window."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, blocks = 2, 64, -(-PROBE_KV_LEN // PROBE_BLOCK)
    dtype, scale = torch.bfloat16, dim**-0.5
    key_cache = (0.5 * torch.randn(blocks, PROBE_BLOCK, heads, dim, generator=gen)).to(dtype)
    value_cache = 0.1 * torch.randn(blocks, PROBE_BLOCK, heads, dim, generator=gen)
    flat = value_cache.view(-1, heads, dim)
    flat[:PROBE_KV_LEN - PROBE_WINDOW] -= 1.0  # outside the window: about -1; inside: about +1
    flat[PROBE_KV_LEN - PROBE_WINDOW:] += 1.0
    value_cache = value_cache.to(dtype)
    query = torch.randn(1, heads, dim, generator=gen).to(dtype)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    sink = torch.tensor([0.5, -0.5], dtype=dtype) if sinks else None
    band = _reference(query, key_cache, value_cache, table, scale, PROBE_WINDOW, sink)
    full = _reference(query, key_cache, value_cache, table, scale, None, sink)
    device = kernels.device
    q, k, v, t = (x.to(device) for x in (query, key_cache, value_cache, table))
    s = None if sink is None else sink.to(device)
    out = torch.empty_like(q)
    nbytes = kernels.workspace_nbytes(tiling.FIA, q, k, v, t, [1], [PROBE_KV_LEN], scale, out, PROBE_WINDOW, s)
    kernels.launch_fia(q, k, v, t, [1], [PROBE_KV_LEN], scale, torch.empty(nbytes, dtype=torch.uint8, device=device),
                       out, PROBE_WINDOW, s)
    got = out.float().cpu()
    band_err, full_err = float((got - band).abs().max()), float((got - full).abs().max())
    if band_err > PROBE_TOL and full_err > PROBE_TOL:
        log.warning("ascend_compile: the S=1 band probe's FIA output matches neither the windowed reference (max "
                    "error %.3g) nor the full one (%.3g): read as the band not applied", band_err, full_err)
    return band_err <= PROBE_TOL and band_err < full_err
