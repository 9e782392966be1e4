"""Whether FIA's band (`ops/npu/features.py`) applies to a call whose every sequence has one query token,
and which `pre_tokens` makes it a layer's window (its edge), asked of the device itself: once per process,
device and layer form (`BandForm`: the layer's own heads, KV heads, head dim, dtype, block size and sinks, since
the kernel's tiling takes another path for another form, `ops/npu/form_probe.py`), at compile time
(`targets.NpuTarget.check_graph`), its answers kept in the persisted plan (`plan_cache.py`: a warm start calls no
probe). A probe call the device refuses (its RuntimeError, an aclnn error) is read as "neither": no window served
on FIA for the edge probe, the band not applied at S 1 for the other, the exact side either way.

Lines `Lnnnn` are of torch_npu 2.14's `_op_plugin_docs.py`. By the docs a call whose query has S 1 is FIA's
IncreFlashAttention branch ("当Query矩阵的S为1, 进入IncreFlashAttention分支", L8056, v2 L8580); the kernel source
gives no TND call of this project that branch (ops-transformer c29bc106 `fused_infer_attention_score_tiling.cpp`
`IsUsingIFA` L687-734: TND is routed by head dim, rope and quantisation, PFA here; bfbbec83 L1259-1374,
L1789-1803), so the docs' S-1 rules below may not be what a TND call meets: the probe asks. In TND, S 1 is
read as a call whose every sequence has one query token (the padding never gives one none: `passes/padding.py`),
every decode step. For that branch the docs say the band's arguments have no effect: `pre_tokens` and
`next_tokens` "Q_S为1时该参数无效" (L8110, L8111; v2 L8629, L8630), and `sparse_mode` too, "Q_S为1且不带rope输入时
该参数无效" (L8117, v2 L8635). vLLM-Ascend passes them in its decode graphs nevertheless
(`attention_v1.py` `full_graph_fia` L942, `full_graph_fia_v2` L1127, L1204), which holds only if the band
does apply there. The two readings differ exactly where a window matters, a decode step with a sequence
longer than its window, and a wrong reading would attend the whole context silently. So neither is
assumed: `band_at_single_query` runs one call of the real kernel (one sequence, one query token, KV
length 200 in the layer's blocks, a window of 16, random data of the layer's dtype whose values inside and outside
the window differ by 2) and compares it with the reference kernel (`ops/reference.py`) with and without the
window. It answers True only when the output is the windowed one; an output matching neither is
logged as a warning and read as False, the exact side.

Where the band does not apply at S 1, a decode step with a sequence longer than a windowed layer's window
runs eagerly, through the model's own attention (`passes/npu_checks.window_guard`), and the binding
refuses such a call (`REFUSAL`, `NpuKernels.fused_infer_attention`), so nothing computes it silently
wrong. Steps with a sequence of several query tokens (PromptFlashAttention, where the band's arguments
take effect) and decode steps whose sequences all fit their window (the band then cuts nothing) keep
their graphs, their calls made without the band (`single_query`): what the device's band does at S 1 is then
never read, so a device whose band there matches neither reading (a probe output of neither, or a refused call)
computes them exactly too. The other ways considered are not exact or not sound: giving FIA only the window's blocks
(a shifted block table) reads from the window's first *block*, exact only where the window starts at
a block's first key; an explicit mask at S 1 (sparse 0 with `(B, 1, Q_S, KV_S)`, L8077-8078; `(B, KV_S)`
only in BSH / BSND / BNSD, L8079), rebuilt on the device every step, at least `maxBlockNumPerSeq *
blockSize` wide with paged KV (L8226), is a second reading no device has checked in place of the first.

The band's edge, asked the same way (`band_edge`, `pre_tokens`): how many keys a band of `pre_tokens` P
attends at several query tokens per sequence (PromptFlashAttention, where the band's arguments take
effect). The docs' band holds the keys from P before the query's own to it ("参数起点为右下角", L1645;
L1636-1645, L8200, L8735): P + 1 keys, so a window of W keys is `pre_tokens = W - 1`. vLLM-Ascend passes
`pre_tokens = W` (`attention_v1.py` L942, L1127, L1204, L1431): P keys. The two differ by the key exactly
at the window's edge, silently. So one call of the real kernel (one sequence of 4 query tokens, KV 200, P
= 15) whose keys are arranged so that the oldest key of each query's window dominates its softmax (its
logit 4 above the next key's) is compared with the reference for windows 15, 16 and 17: 16 is the docs'
reading (`pre_tokens = W - 1`), 15 vLLM-Ascend's (`pre_tokens = W`); 17, or none of them, is a band
neither reading means, and then no windowed layer is served on FIA at all (the binding refuses such a
call; its graphs run eagerly, `windowed_refusal`), with a WARNING saying why. The offset is taken as the
same for every window (the docs define the band by `pre_tokens` alone).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Sequence

import torch

from ... import plan_cache
from .. import reference, tiling
from ..features import AttentionFeatures
from ..tiling import AttentionShape

log = logging.getLogger("ascend_compile")

#: The probe's window, KV length and tolerance (half-precision outputs of magnitude ~1).
PROBE_WINDOW, PROBE_KV_LEN, PROBE_TOL = 16, 200, 0.05
#: The edge probe's softmax scale: its logits are the keys' first channel (the query's is 8).
EDGE_SCALE = 0.125

REFUSAL = ("torch_npu 2.14's docs say FIA's pre_tokens and next_tokens have no effect when every sequence has "
           "one query token ('Q_S为1时该参数无效', _op_plugin_docs.py L8110, L8111, L8629, L8630), and this device's "
           "probe found its band not applied there (ops/npu/band_probe.py)")

#: The edge probe's query tokens (one sequence of several: PromptFlashAttention by the docs, L8056).
EDGE_QUERY_LEN = 4
#: The keys a band of `pre_tokens` P attends beyond P, by reading: the docs' (P before the query's own,
#: and its own) and vLLM-Ascend's (P, its own among them).
READINGS = {1: "the docs' band, pre_tokens = W - 1 (_op_plugin_docs.py L1636-1645, L8200, L8735)",
            0: "vLLM-Ascend's, pre_tokens = W (vllm_ascend/attention/attention_v1.py L942, L1127, L1204, L1431)"}

EDGE_REFUSAL = ("this device's FIA band probe at several query tokens (ops/npu/band_probe.py) found a band of "
                "pre_tokens W - 1 attending neither W keys (the docs' band, _op_plugin_docs.py L1636-1645, L8200) "
                "nor W - 1 (vLLM-Ascend's pre_tokens = W, attention_v1.py L942): no pre_tokens is known to serve a "
                "window, so windowed layers are not served on FIA")



@dataclasses.dataclass(frozen=True)
class BandForm:
    """A windowed FIA layer's form, what the kernel's tiling branches on (`ops/npu/form_probe.py`): the probes
    are asked at it, with the layer's own tensors' shapes and dtype, FIA v2 (`learnable_sink`) with sinks."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sinks: bool

    def __str__(self) -> str:
        return (f"{'v2-sinks' if self.sinks else 'v1'} (heads {self.heads}, KV heads {self.kv_heads}, head dim "
                f"{self.head_dim}, {str(self.dtype).removeprefix('torch.')}, blocks of {self.block_size})")


def form(shape: AttentionShape, dtype: torch.dtype, sinks: bool) -> BandForm:
    """The band form of a layer of `shape` and `dtype`, with or without sinks."""
    return BandForm(shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype, shape.block_size, bool(sinks))


def form_of_call(query: torch.Tensor, key_cache: torch.Tensor, sinks: bool) -> BandForm:
    """The band form of a FIA call's query `[T, H, D]` and cache `[blocks, block_size, KVH, D]`."""
    return BandForm(int(query.shape[1]), int(key_cache.shape[2]), int(query.shape[2]), query.dtype,
                    int(key_cache.shape[1]), bool(sinks))


#: The answers, per torch_npu module (a process has one; each fake a test installs is another), then
#: per (device, form).
_ANSWERS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, BandForm], bool]]" = weakref.WeakKeyDictionary()
#: The edge probe's answers, alike: the keys a band of P attends beyond P (`READINGS`), None for neither.
_EDGES: "weakref.WeakKeyDictionary[Any, dict[tuple[str, BandForm], int | None]]" = weakref.WeakKeyDictionary()


def single_query(query_ends: Sequence[int]) -> bool:
    """Whether a call is FIA's S-1 branch: every sequence one query token (ends `[1, 2, ..., B]`). Where the S=1
    probe found the band not applied there (ignored, or broken: an output matching neither reference, or refused),
    such a call of a windowed layer is made without the band (`NpuKernels.fused_infer_attention`): exact for the
    calls it serves, whose every sequence fits the window, whatever the device's band does at S 1."""
    ends = [int(e) for e in query_ends]
    return bool(ends) and ends == list(range(1, len(ends) + 1))


def single_query_outside(query_ends: Sequence[int], kv_lens: Sequence[int], window: int | None) -> bool:
    """Whether a call is FIA's S-1 branch (every sequence one query token: ends `[1, 2, ..., B]`) with a
    sequence longer than `window`: the calls the two readings compute differently."""
    return window is not None and single_query(query_ends) and max(int(n) for n in kv_lens) > window


def known(kernels: Any) -> dict[BandForm, bool]:
    """The answers asked so far on `kernels`' device, by form (for plan.json)."""
    answers = _ANSWERS.get(kernels.torch_npu, {})
    return {f: a for (device, f), a in answers.items() if device == str(kernels.device)}


def known_edges(kernels: Any) -> dict[BandForm, int | None]:
    """The edge probe's answers asked so far on `kernels`' device, by form (for plan.json)."""
    edges = _EDGES.get(kernels.torch_npu, {})
    return {f: e for (device, f), e in edges.items() if device == str(kernels.device)}


def band_edge(kernels: Any, form: BandForm) -> int | None:
    """How many keys FIA's band of `pre_tokens` P attends beyond P on `kernels`' device, for a layer of `form`:
    1 (the docs' reading), 0 (vLLM-Ascend's), or None (neither, or the device refused the probe's call: no
    window served); the edge probe's answer, asked once per form and logged (INFO, or WARNING for None)."""
    edges = _EDGES.setdefault(kernels.torch_npu, {})
    key = (str(kernels.device), form)
    if key not in edges:
        edges[key] = _edge_probe(kernels, form)
        if edges[key] is None:
            log.warning("ascend_compile: FIA %s on %s: %s", key[1], key[0], EDGE_REFUSAL)
        else:
            log.info("ascend_compile: FIA %s on %s attends %d keys for pre_tokens %d at several query tokens (the "
                     "band edge probe): %s, windowed layers pass pre_tokens = W%s", key[1], key[0],
                     PROBE_WINDOW - 1 + edges[key], PROBE_WINDOW - 1, READINGS[edges[key]],
                     " - 1" if edges[key] else "")
    return edges[key]


def pre_tokens(kernels: Any, window: int | None, form: BandForm) -> int | None:
    """FIA's `pre_tokens` for a layer of `window` (None without one) and `form` on `kernels`' device, as its edge
    probe found (`band_edge`); None with a window where the probe found neither reading."""
    if window is None:
        return None
    edge = band_edge(kernels, form)
    return None if edge is None else int(window) - edge


def windowed_refusal(kernels: Any, form: BandForm) -> str | None:
    """Why a windowed layer of `form` is not served on FIA on `kernels`' device, or None where it is."""
    return EDGE_REFUSAL if band_edge(kernels, form) is None else None


def band_at_single_query(kernels: Any, form: BandForm) -> bool:
    """Whether FIA's band applies when every sequence has one query token, on `kernels`' device, for a layer
    of `form`: the probe's answer (False where the device refused its call), asked once per form and logged."""
    answers = _ANSWERS.setdefault(kernels.torch_npu, {})
    key = (str(kernels.device), form)
    if key not in answers:
        answers[key] = _probe(kernels, form)
        log.info("ascend_compile: FIA %s on %s %s the band (sparse_mode 4, pre_tokens) to a call whose every "
                 "sequence has one query token (the S=1 band probe): %s", key[1], key[0],
                 "applies" if answers[key] else "does not apply",
                 "windowed layers keep their decode graphs" if answers[key] else "decode steps with a sequence "
                 "longer than a layer's window run eagerly")
    return answers[key]


def _reference(query, key_cache, value_cache, table, scale, window, sinks) -> torch.Tensor:
    out, q = torch.empty_like(query), int(query.shape[0])
    features = AttentionFeatures(window, None, sinks is not None)
    spans = [features.span(PROBE_KV_LEN, q)]
    workspace = torch.empty(tiling.workspace_nbytes(tiling.FIA, tiling.AttentionShape.of(query, key_cache), spans,
                                                    [q]), dtype=torch.uint8)
    reference.fused_infer_attention(query, key_cache, value_cache, table, [q], [PROBE_KV_LEN], [q], scale, workspace,
                                    out, features, sinks)
    return out.float()


def _device_output(kernels, query, key_cache, value_cache, table, scale, pre, sink) -> torch.Tensor | None:
    """The device's FIA for the probe's one sequence with `pre_tokens` `pre`, on the host in float32; None where
    the device refused the call (its RuntimeError, logged)."""
    device, ends = kernels.device, [int(query.shape[0])]
    q, k, v, t = (x.to(device) for x in (query, key_cache, value_cache, table))
    s = None if sink is None else sink.to(device)
    out = torch.empty_like(q)
    try:
        nbytes = kernels.band_workspace_nbytes(q, k, v, t, ends, [PROBE_KV_LEN], scale, out, pre, s)
        kernels.launch_fia(q, k, v, t, ends, [PROBE_KV_LEN], scale,
                           torch.empty(nbytes, dtype=torch.uint8, device=device), out, pre, s)
    except RuntimeError as err:
        log.warning("ascend_compile: the device refused a band probe's FIA call (read as neither reading): %s", err)
        return None
    return out.float().cpu()


def _sinks(form: BandForm) -> torch.Tensor | None:
    """The probes' `learnable_sink` for a layer of `form` (bfloat16, one per query head), or None."""
    return torch.tensor([0.5, -0.5], dtype=torch.bfloat16).repeat(-(-form.heads // 2))[:form.heads] \
        if form.sinks else None


@plan_cache.remembered("npu_probes", question=lambda kernels, form: ("band edge", form))
def _edge_probe(kernels: Any, form: BandForm) -> int | None:
    """One call of the device's FIA at several query tokens with `pre_tokens` W - 1 against the reference
    for windows W - 1, W and W + 1, in the layer's form: the keys it attends beyond `pre_tokens` (1 or 0), None
    for neither."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, q_len = form.heads, form.kv_heads, form.head_dim, form.block_size, EDGE_QUERY_LEN
    blocks, dtype, scale = -(-PROBE_KV_LEN // block), form.dtype, EDGE_SCALE
    first = PROBE_KV_LEN - q_len - PROBE_WINDOW - 4  # the oldest key any of the three windows holds, less some
    pos = torch.arange(blocks * block, dtype=torch.float32)
    # Logit of key j: 4 * (first - j) + 16 for j >= first (older keys dominate), -100 before; its value's first
    # channel (j - first - 12) / 4: each query's output is about its window's oldest value, 0.25 apart per key
    # (bfloat16 and float16 hold every one of these exactly).
    logit = torch.where(pos >= first, 4.0 * (first - pos) + 16.0, torch.full_like(pos, -100.0))
    key_cache = 0.01 * torch.randn(blocks * block, kv_heads, dim, generator=gen)
    key_cache[:, :, 0] = logit.view(-1, 1)
    value_cache = 0.1 * torch.randn(blocks * block, kv_heads, dim, generator=gen)
    value_cache[:, :, 0] = ((pos - first - 12.0) / 4.0).clamp(-4.0, 4.0).view(-1, 1)
    query = 0.01 * torch.randn(q_len, heads, dim, generator=gen)
    query[:, :, 0] = 1 / scale  # times the scale: the logit above
    key_cache, value_cache = (x.to(dtype).view(blocks, block, kv_heads, dim) for x in (key_cache, value_cache))
    query = query.to(dtype)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    sink = _sinks(form)
    got = _device_output(kernels, query, key_cache, value_cache, table, scale, PROBE_WINDOW - 1, sink)
    if got is None:
        return None
    errs = {w: float((got - _reference(query, key_cache, value_cache, table, scale, w, sink)).abs().max())
            for w in (PROBE_WINDOW - 1, PROBE_WINDOW, PROBE_WINDOW + 1)}
    window = min(errs, key=errs.get)
    if errs[window] > PROBE_TOL or sum(e <= PROBE_TOL for e in errs.values()) > 1 or window == PROBE_WINDOW + 1:
        log.warning("ascend_compile: the band edge probe's FIA output for pre_tokens %d, against the windows "
                    "%s (max errors): %s", PROBE_WINDOW - 1, list(errs), [f"{e:.3g}" for e in errs.values()])
        return None
    return window - (PROBE_WINDOW - 1)


@plan_cache.remembered("npu_probes", question=lambda kernels, form: ("band at one query token", form))
def _probe(kernels: Any, form: BandForm) -> bool:
    """One call of the device's FIA at S 1 in the layer's form against the reference with and without the window."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = form.heads, form.kv_heads, form.head_dim, form.block_size
    blocks, dtype, scale = -(-PROBE_KV_LEN // block), form.dtype, dim**-0.5
    key_cache = (0.5 * torch.randn(blocks, block, kv_heads, dim, generator=gen)).to(dtype)
    value_cache = 0.1 * torch.randn(blocks, block, kv_heads, dim, generator=gen)
    flat = value_cache.view(-1, kv_heads, dim)
    flat[:PROBE_KV_LEN - PROBE_WINDOW] -= 1.0  # outside the window: about -1; inside: about +1
    flat[PROBE_KV_LEN - PROBE_WINDOW:] += 1.0
    value_cache = value_cache.to(dtype)
    query = torch.randn(1, heads, dim, generator=gen).to(dtype)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    sink = _sinks(form)
    pre = pre_tokens(kernels, PROBE_WINDOW, form)  # the edge probe's, so that the band means the window
    if pre is None:
        return False  # no window served on FIA at all (`windowed_refusal`)
    band = _reference(query, key_cache, value_cache, table, scale, PROBE_WINDOW, sink)
    full = _reference(query, key_cache, value_cache, table, scale, None, sink)
    got = _device_output(kernels, query, key_cache, value_cache, table, scale, pre, sink)
    if got is None:
        return False
    band_err, full_err = float((got - band).abs().max()), float((got - full).abs().max())
    if band_err > PROBE_TOL and full_err > PROBE_TOL:
        log.warning("ascend_compile: the S=1 band probe's FIA output matches neither the windowed reference (max "
                    "error %.3g) nor the full one (%.3g): read as the band not applied", band_err, full_err)
    return band_err <= PROBE_TOL and band_err < full_err
