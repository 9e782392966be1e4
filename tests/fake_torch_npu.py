"""A fake torch_npu (and `torch.npu`) on the ACL-graph simulator, so CI runs the NPU path.

It plays one of the releases the project is bound to (`VERSIONS`): 2.14.0 by default, or 2.10.0.post4
(vLLM-Ascend's pin), chosen per test (`install(monkeypatch, version=...)`). Each has the fixture read from its
wheel (`tests/fixtures/torch_npu_2_14_schemas.txt`, `torch_npu_2_10_0_post4_schemas.txt`), and the fake of a
version offers only what that fixture lists (ops, `torch.npu` functions, `torch_npu._C` names) and reports it
as `torch_npu.__version__`; where the two wheels' Python differs in what the fake plays, it follows the version
(`Release`: `torch.npu.graph`'s entry). The `_op_plugin_docs.py` lines its refusals quote are 2.14.0's; 2.10.0.post4
has the same text 44 lines earlier (37 for npu_fusion_attention's L1636-1645: docs/ascend.md, "torch_npu
2.10.0.post4 and 2.14.0").

It offers, with the real names and signatures, what ascend_compile calls: the graph API of `torch.npu`
(`NPUGraph`, `graph`, `graph_pool_handle`, `graph_task_group_begin/end`, `graph_task_update_begin/end`, `Stream`, `Event`, `ExternalEvent`,
`stream`, `current_stream`, `synchronize`, `get_rng_state` / `set_rng_state` / `manual_seed(_all)` /
`default_generators` (the NPU's own generator, apart from the CPU's), `empty_cache`,
`host_empty_cache`, `get/set_stream_limit`, ...), `torch_npu._C._weak_ref_tensor`, the attention kernels
with their workspace queries (FIA v2's MLA form in `tests/fake_torch_npu_mla.py`; FIA's band mode and FIA
v2's `learnable_sink` in `tests/fake_torch_npu_features.py`), and the KV-cache write `npu_scatter_pa_kv_cache`. The kernels are defined in torch's op registry from the
wheel's own schema strings, in the real namespaces (`torch.ops.atb`, `torch.ops.npu`), so a call
with a wrong argument name, order or kind fails here as it does on the device, and the simulator
records each call as one task: the ops of torch_npu's namespaces are the device's kernels
(`DEVICE_KERNELS`), and any other op in a captured graph is recorded as the ops its body issues, so
a host read inside it fails the capture as on the device. They compute for real, with the project's reference kernels, and
their workspace queries answer with the reference tiling (whose need peaks at an interior length).

The device is the CPU and the simulator (`ascend_compile/runtime/sim/`) plays the ACL runtime; its
random kernel (`torch.multinomial`, a sampler's) draws from the NPU's generator, not the CPU's, and
`torch.manual_seed` seeds both, as with torch_npu loaded:
captured ops become tasks, capture-time memory is poisoned, host arguments are frozen until a task
update, and a replay that reaches an external event nobody recorded raises instead of hanging.
Each fake `Stream` is a simulator stream and each `Event` / `ExternalEvent` a simulator event, so
replays, task updates and event records run asynchronously, ordered only by stream order and
events: an update no event orders before the kernel it rewrites is a `StreamRace`, and a wait that
nothing queued can satisfy (an update queued behind the replay waiting for it) raises naming the
node. The kernels keep the device's rules the simulator models (`SimRuntime`): they set
themselves up on their first call, which may not be inside a capture; with every length 0 they take
a fast path that records another task than real lengths do; PA's CPU `context_lens` is copied when
the call is issued, as torch_npu's ATB binding clones CPU inputs. Each refuses what its torch_npu
documentation forbids (quoted where checked): FIA and PA, queries and caches of other dtypes than
float16/bfloat16 (float32 is none of theirs); FIA, for paged TND calls, a block size that is not a
multiple of 128 in [128, 512], a cache with fewer blocks than the sequences' lengths need and
non-contiguous query or caches (a KV length below the query length, which vLLM-Ascend pads with, is
accepted: the docs ask only for non-negative lengths of at most KV_S), more than 64 query heads per KV
head, a head dim above 512 or not a multiple of 16; PA a block size that is not a multiple of 16 of at
most 128, a head size above 256 and a non-contiguous `out` (its inputs it copies contiguous, as ATB's
binding does); the `.out` overloads' softmax_lse is reserved (any tensor, never written); the cache
write non-contiguous inputs, slot
dtypes other than int32/int64, slots past the cache or repeated (negative ones it skips, as the
kernel source does). FIA's max-workspace query answers the most any lengths the block table holds
can need, in the query's dtype (its bytes are `numel * element_size`); under `fia_workspace=` it answers per form
instead, as the older kernel source sizes it (a call whose every sequence has one query token asks more) or as a
device sizing v1, its band and v2 with sinks apart, and its kernel refuses less than its call's form needs
(`tests/fake_torch_npu_sources.py`). A query and caches of different half dtypes are the device's refusal (a
RuntimeError: no kernel is built for the pair, `fake_torch_npu_sources.MIXED_HALVES`). PA's query, like its kernel,
refuses lengths its block table's rows do not hold. Each stream has a core limit;
a task update issued on a stream limited otherwise than the task's capture is refused (it would
re-tile the kernel for other cores). `graph.__enter__` empties both allocators' caches as torch_npu's
does. `HostReads` records host reads of tensor data (what a device kernel's binding must not issue),
and `AllocatedBytes` the device memory ops allocate.
The call log keeps tensors as meta tensors (shape and dtype only), so it holds no memory alive.
`install(monkeypatch)` puts the fake in `sys.modules` for one test.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import sys
import types
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ascend_compile.ops import library, reference, tiling, validate
from ascend_compile.ops.features import AttentionFeatures
from ascend_compile.runtime import npu as runtime_npu
from ascend_compile.runtime.sim import SimRuntime
from tests.fake_torch_npu_batches import TaskBatches

FIXTURES = Path(__file__).parent / "fixtures"


@dataclasses.dataclass(frozen=True)
class Release:
    """A torch_npu release the fake plays: its fixture (read from its wheel) and where its Python differs."""

    version: str
    fixture: Path
    #: Whether `torch.npu.graph.__enter__` empties the host allocator's cache too: 2.14.0 calls
    #: `host_empty_cache()` there (`torch_npu/npu/graphs.py` L906), 2.10.0.post4 `empty_cache()` only (L861-868).
    graph_enter_empties_host_cache: bool


#: The releases, by `torch_npu.__version__`.
VERSIONS: dict[str, Release] = {
    "2.14.0": Release("2.14.0", FIXTURES / "torch_npu_2_14_schemas.txt", graph_enter_empties_host_cache=True),
    "2.10.0.post4": Release("2.10.0.post4", FIXTURES / "torch_npu_2_10_0_post4_schemas.txt",
                            graph_enter_empties_host_cache=False),
}
#: The release the fake plays unless told otherwise; its fixture defines the ops (`_define_ops`).
VERSION = "2.14.0"
FIXTURE = VERSIONS[VERSION].fixture
#: The device's kernels besides torch's own: the ops of torch_npu's namespaces. Any other op the
#: graphs hold (an `ascend` op that has no torch_npu binding) is recorded as the ops its body issues,
#: so a host read in its body fails the capture, as on the device.
DEVICE_KERNELS = ("atb", "npu")

#: FIA arguments the fake computes with; any other optional tensor must be left None.
_FIA_USED = {
    "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads", "scale",
    "input_layout", "num_key_value_heads", "sparse_mode", "block_size", "workspace", "out", "pre_tokens",
    "next_tokens",
}
#: FIA arguments that do not change the result of the calls the fake accepts (the `.out` overload's
#: softmax_lse is reserved, L8534, whatever the flag).
_FIA_IGNORED = {"inner_precise", "softmax_lse_flag"}


def read_fixture(version: str = VERSION) -> dict[str, list[str]]:
    """The sections of `version`'s fixture ("schema atb", "schema npu", "python torch.npu", "names torch_npu._C")
    and their lines."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in release(version).fixture.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            current.append(line)
    return sections


def release(version: str) -> Release:
    """The release `version` names, or an error listing the ones the fake plays."""
    if version not in VERSIONS:
        raise ValueError(f"version: the fake torch_npu plays {', '.join(VERSIONS)}, not {version!r}")
    return VERSIONS[version]


def schemas(version: str = VERSION) -> dict[str, torch.FunctionSchema]:
    """`name[.overload]` -> parsed schema of every op in `version`'s fixture."""
    out = {}
    for section in ("schema atb", "schema npu"):
        for text in read_fixture(version)[section]:
            schema = torch._C.parse_schema(text)
            out[schema.name + (f".{schema.overload_name}" if schema.overload_name else "")] = schema
    return out


def python_names(version: str = VERSION) -> set[str]:
    """The `torch.npu` names `version`'s fixture lists (a class for each of its methods)."""
    return {line.split("(")[0].split(".")[0] for line in read_fixture(version)["python torch.npu"]}


# ----------------------------------------------------------------------------- the kernels


def _fail(arg: str, expected: str, got: Any) -> None:
    raise ValueError(f"{arg}: expected {expected}, got {got}")


#: The kernel source's bound on a TND call's length lists (ops-transformer c29bc106
#: `prompt_flash_attention_tiling.cpp` L4275-4278, `MAX_VAR_LEN_SEQ_LEN` = 4096), FIA's and FIA v2's alike.
TND_MAX_ENTRIES = 4096


def device_refusal(arg: str, expected: str, got: Any) -> None:
    """A refusal the kernel's own tiling makes (an `OP_CHECK_IF` of the kernel source): on a device the aclnn
    call fails and torch_npu raises a RuntimeError, not the ValueError of the docs' rules the fake also checks."""
    raise RuntimeError(f"EZ9999: fake aclnn: {arg}: expected {expected}, got {got}")


def kernel_source() -> str | None:
    """The FIA kernel source the installed fake plays (`tests/fake_torch_npu_sources.py`), None for the docs only."""
    return _ACTIVE.kernel_source if _ACTIVE is not None else None


def tnd_entries(ends: list[int], kv_lens: list[int], source: str) -> None:
    """The kernel's bound on a TND call's lists (`TND_MAX_ENTRIES`), refused as the device refuses it."""
    if max(len(ends), len(kv_lens)) > TND_MAX_ENTRIES:
        device_refusal("actual_seq_lengths", f"at most {TND_MAX_ENTRIES} entries per length list ({source})",
                       f"{len(ends)} and {len(kv_lens)}")


def _host_lengths(name: str, t: torch.Tensor) -> list[int]:
    """ATB reads `context_lens` on the host: a 1-D CPU int32 tensor."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.int32 or t.dim() != 1:
        _fail(name, "a 1-D CPU torch.int32 tensor (ATB reads it on the host)", f"{getattr(t, 'dtype', t)} "
              f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}")
    return [int(v) for v in t]


def _executed(kernel: str, kv_lens: list[int]) -> None:
    """Note a kernel execution (capture runs each op once; replays run them again); the kernel's
    first call sets it up, which the simulator refuses inside a capture."""
    if _ACTIVE is not None:
        _ACTIVE.sim.first_call(kernel)
        _ACTIVE.executed.append((kernel, tuple(kv_lens)))


def _contiguous(source: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            _fail(name, f"a contiguous tensor ({source})", f"strides {t.stride()}")


def _half(name: str, t: torch.Tensor, source: str) -> None:
    """The kernels take float16/bfloat16 (float32 nowhere; int8 is a quantised form the fake does not implement)."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        _fail(name, f"a float16 or bfloat16 tensor ({source})", t.dtype)


def _pa_shapes(query, key_cache, value_cache, num_kv_heads, num_heads, out) -> None:
    """PA's documented shape rules: "因硬件限制，block_size %16 == 0 ... 因硬件限制，block_size <= 128"
    (`op_plugin/atb/_atb_api_docs.py` L275-276, `_npu_paged_attention_v2`, ATB's same PagedAttentionOperation),
    "head_size范围为（0, 256]" (L278), half-precision query and caches ("支持float16/bf16/int8", L254-255, L262;
    int8 is the quantised form) and `out` ("数据类型为float16/bf16", L272), and a contiguous `out`: torch_npu's
    ATB binding makes every input contiguous (op-plugin `AtbCommon.cpp`, `ParamSetter::Input`:
    `tensor.contiguous()`) but passes an output as it is to `AtTensor2AtbTensor`, whose
    `TORCH_CHECK(at_tensor.is_contiguous(), "at_tensor is not contiguous")` refuses a strided one."""
    for name, t, line in (("query", query, "L254"), ("key_cache", key_cache, "L255"), ("value_cache", value_cache,
                                                                                        "L262"), ("out", out, "L272")):
        _half(name, t, f"ATB PagedAttention: '支持float16/bf16/int8', _atb_api_docs.py {line}")
    if not 0 < query.shape[2] <= 256:
        _fail("query", "a head size in (0, 256] ('head_size范围为（0, 256]', _atb_api_docs.py L278)", query.shape[2])
    _contiguous("ATB's AtTensor2AtbTensor: 'at_tensor is not contiguous' (outputs are not copied)", out=out)
    if num_heads != query.shape[1]:
        _fail("num_heads", f"the query's head count {query.shape[1]}", num_heads)
    if num_kv_heads != key_cache.shape[2]:
        _fail("num_kv_heads", f"the cache's KV head count {key_cache.shape[2]}", num_kv_heads)
    block_size = key_cache.shape[1]
    if block_size % 16 or block_size > 128:
        _fail("block_size", "a multiple of 16 of at most 128 (ATB PagedAttention: '因硬件限制，block_size %16 == 0', "
              "'block_size <= 128')", block_size)


def _pa(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out, *,
        workspace=None):
    lens = _host_lengths("context_lens", context_lens)
    _pa_shapes(query, key_cache, value_cache, num_kv_heads, num_heads, out)
    # ATB's binding copies inputs contiguous (ParamSetter::Input), as the kernel then reads them.
    query, key_cache, value_cache = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    if workspace is None:  # ATB allocates its own scratch
        shape = tiling.AttentionShape.of(query, key_cache)
        workspace = torch.empty(tiling.workspace_nbytes(tiling.PA, shape, lens), dtype=torch.uint8)
    _half("out", out, "ATB PagedAttention: '数据类型为float16/bf16', _atb_api_docs.py L272")
    library.check_paged_attention(query, key_cache, value_cache, block_table, lens, workspace, out)
    _executed(tiling.PA, lens)
    reference.paged_attention(query, key_cache, value_cache, block_table, lens, scale_value, workspace, out)


def _pa_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens,
                  out):
    """The bytes PA needs for this call: asked with the kernel's arguments, which are held to the
    kernel's rules, lengths that fit the block table's rows included (a question about a call the
    kernel refuses has no answer)."""
    lens = _host_lengths("context_lens", context_lens)
    _pa_shapes(query, key_cache, value_cache, num_kv_heads, num_heads, out)
    validate.check_lengths(lens, [1] * len(lens), block_table.shape[1], key_cache.shape[1], "context_lens")
    nbytes = tiling.workspace_nbytes(tiling.PA, tiling.AttentionShape.of(query, key_cache), lens)
    return torch.empty(nbytes, dtype=torch.uint8, device=query.device)


def _fia_arguments(schema: torch.FunctionSchema, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments with the schema's defaults filled in (the dispatcher passes only the
    ones given), refusing features the fake does not compute."""
    defaults = {a.name: a.default_value for a in schema.arguments if a.kwarg_only and a.has_default_value()}
    for name, value in kwargs.items():
        if name not in _FIA_USED and name not in _FIA_IGNORED and not _same(value, defaults.get(name)):
            raise NotImplementedError(f"{name}: the fake FIA does not implement it (leave it at its default)")
    return {**defaults, **kwargs}


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return value is default
    return value == default


def _fia_layout(query, key, value, kw) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int],
                                               int | None]:
    """Checks of FIA's TND, paged-KV call; (4-D key cache, value cache, ends, kv lens, query lens, window).

    The device's rules, from torch_npu 2.14's `_op_plugin_docs.py` (npu_fused_infer_attention_score):
    TND needs both length lists (L8082-8083); paged attention needs `block_table` (L8222), two-dimensional
    with a row per batch entry (L8223), and a
    block size that is a multiple of 128 in [128, 512] (L8219), and `num_blocks` at least the sum of
    the blocks each sequence's KV length needs (L8220); sparse_mode 3 and 4 take the (2048, 2048) lower-
    triangular mask (L8121-8122, L8214), 4 its band's `pre_tokens` / `next_tokens`
    (`fake_torch_npu_features.band_window`: the window it computes). KV lengths are non-negative and at
    most KV_S (L8211, L8275), which `library.check_fused_infer_attention` checks; nothing asks a KV length
    to cover the query length in this layout (L8199 and L8248-8249 do for D=192 without paged attention
    and for int8 outputs only). The layout, the argument names and sparse modes 0 / 3 / 4 are what the
    fake computes.
    """
    from tests import fake_torch_npu_sources  # it builds on this module's refusals
    from tests.fake_torch_npu_features import band_window  # it builds on this module's checks
    if kw["input_layout"] != "TND":
        _fail("input_layout", "'TND' (the fake implements the TND layout)", repr(kw["input_layout"]))
    if kw["block_table"] is None:
        _fail("block_table", "a [B, max_blocks] int32 tensor (paged KV)", None)
    if kw["actual_seq_lengths"] is None or kw["actual_seq_lengths_kv"] is None:
        _fail("actual_seq_lengths", "both actual_seq_lengths and actual_seq_lengths_kv (TND requires them)", None)
    if kw["block_table"].dim() != 2 or kw["block_table"].shape[0] != len(kw["actual_seq_lengths_kv"]):
        _fail("block_table", f"a row per batch entry, {len(kw['actual_seq_lengths_kv'])} ('page attention场景下, "
              f"block_table必须为二维, 第一维长度需等于B', L8223)", tuple(kw["block_table"].shape))
    if key.dim() != 3 or value.shape != key.shape:
        _fail("key", "a [num_blocks, block_size, KVH*D] cache (and value alike)", tuple(key.shape))
    _contiguous("npu_fused_infer_attention_score: '不支持非连续的Tensor'", query=query, key=key, value=value)
    for name, t, line in (("query", query, "L8065"), ("key", key, "L8067"), ("value", value, "L8070")):
        _half(name, t, f"npu_fused_infer_attention_score: '数据类型支持float16、bfloat16、int8', {line}")
    fake_torch_npu_sources.check_one_half_dtype(query, key, value)
    heads, dim = query.shape[1], query.shape[2]
    if kw["num_heads"] != heads:
        _fail("num_heads", f"the query's head count {heads}", kw["num_heads"])
    kv_heads = kw["num_key_value_heads"]
    if kv_heads < 1 or key.shape[2] != kv_heads * dim:
        _fail("num_key_value_heads", f"KVH with KVH*{dim} == {key.shape[2]} (the cache's last dim)", kv_heads)
    if heads // kv_heads > 64:
        _fail("num_key_value_heads", "at most 64 query heads per KV head ('比值不能大于64', L8116)", kv_heads)
    if heads > 256:
        _fail("num_heads", "at most 256 ('支持N轴小于等于256', L8204, L8271)", heads)
    if dim % 16 or dim > 512:
        _fail("query", "a head dim that is a multiple of 16, at most 512 ('D轴需16对齐', L8210; '支持D轴小于等于512', "
              "L8204, L8271)", dim)
    if kw["block_size"] != key.shape[1]:
        _fail("block_size", f"the cache's block size {key.shape[1]}", kw["block_size"])
    if kw["block_size"] % 128 or not 128 <= kw["block_size"] <= 512:
        _fail("block_size", "a multiple of 128 in [128, 512] (paged FIA)", kw["block_size"])
    fake_torch_npu_sources.check(kernel_source(), query.dtype, heads, kv_heads, dim, kw["block_size"], kw["sparse_mode"],
                                 False, kw["inner_precise"])
    ends, kv_lens = list(kw["actual_seq_lengths"]), list(kw["actual_seq_lengths_kv"])
    tnd_entries(ends, kv_lens, "prompt_flash_attention_tiling.cpp L4275-4278")
    query_lens = validate.query_lens_from_ends(ends, query.shape[0], "actual_seq_lengths")
    needed = sum(-(-n // key.shape[1]) for n in kv_lens)
    if key.shape[0] < needed:
        _fail("key", f"at least {needed} blocks (the sum of every sequence's blocks)", f"{key.shape[0]} blocks")
    window = None
    if kw["sparse_mode"] == 0:
        if kw["atten_mask"] is not None or any(n > 1 for n in query_lens):
            _fail("sparse_mode", "3 with atten_mask for steps with several query tokens (0 is not causal)", 0)
    else:
        window = band_window(kw, query_lens, kv_lens)
    shape4 = (key.shape[0], key.shape[1], kv_heads, dim)
    return key.view(shape4), value.view(shape4), ends, kv_lens, query_lens, window


def _fia_out(query, key, value, **kwargs):
    kw = _fia_arguments(torch.ops.npu.npu_fused_infer_attention_score.out._schema, kwargs)
    key4, value4, ends, kv_lens, query_lens, window = _fia_layout(query, key, value, kw)
    features = AttentionFeatures(window)
    out = kw["out"]
    if len(out) != 2:
        _fail("out", "[attention_out, softmax_lse]", f"{len(out)} tensors")
    attention_out, softmax_lse = out  # softmax_lse: "当前预留，暂不支持" (reserved, L8534): any tensor, not written
    workspace = kw["workspace"]
    if workspace is None:  # aclnn allocates its own scratch
        shape = tiling.AttentionShape.of(query, key4)
        spans = [features.span(n, q) for n, q in zip(kv_lens, query_lens)]
        workspace = torch.empty(tiling.workspace_nbytes(tiling.FIA, shape, spans, query_lens), dtype=torch.uint8)
    if kw["workspace"] is not None:  # aclnn's own is sized by its own tiling
        fia_workspace_check(query, key4, kw, kw["sparse_mode"] == 4, False, workspace)
    library.check_fused_infer_attention(query, key4, value4, kw["block_table"], ends, kv_lens, workspace, attention_out)
    _executed(tiling.FIA, kv_lens)
    reference.fused_infer_attention(query, key4, value4, kw["block_table"], ends, kv_lens, query_lens, kw["scale"],
                                    workspace, attention_out, features)
    return attention_out, softmax_lse


def _fia_out_meta(query, key, value, **kwargs):
    return kwargs["out"][0], kwargs["out"][1]


#: torch_npu 2.14 `_op_plugin_docs.py`, npu_scatter_pa_kv_cache: "输入参数不支持非连续" (inputs may not be
#: non-contiguous) and "slot_mapping（Tensor）：...数据类型支持int32和int64" (int32 and int64 slots).
_SCATTER_DOC = "npu_scatter_pa_kv_cache (torch_npu 2.14 _op_plugin_docs.py)"


def _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                         compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    """`npu_scatter_pa_kv_cache` in its second scenario (key/value `[T, N, D]`, ND caches
    `[num_blocks, block_size, N, D]`, slots `[T]`), refusing what its documentation forbids and
    writing for real. A negative slot is skipped, as the kernel source does
    (ops-transformer `scatter_pa_kv_cache_nd.h`: `if (slotValue < 0) continue;`); the docs allow only
    `[0, num_blocks*block_size-1]` ("slot_mapping的值范围[0,num_blocks*block_size-1]") and distinct
    slots ("元素值保证不重复，重复时不保证正确性"), so a slot past the cache or a repeated one is refused."""
    if cache_mode not in (None, "Norm"):
        _fail("cache_mode", "None or 'Norm' for ND caches ('PA_NZ', the default, takes NZ-format caches)",
              repr(cache_mode))
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("compress_lens/compress_seq_offsets/seq_lens: the fake implements scenario 2 only")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            _fail(name, f"a contiguous tensor ({_SCATTER_DOC}: 输入参数不支持非连续)", f"strides {t.stride()}")
    if key.dim() != 3 or key_cache.dim() != 4 or value.shape[:2] != key.shape[:2]:
        _fail("key", "[T, N, D] key and value with ND caches [num_blocks, block_size, N, D]",
              f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(key_cache.shape)}")
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[:3] != key_cache.shape[:3] or \
            value_cache.shape[3] != value.shape[2]:
        _fail("key_cache", f"[num_blocks, block_size, {key.shape[1]}, D] caches matching key and value",
              f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        _fail("key_cache", "key, value and both caches of one dtype (数据类型必须一致)",
              [t.dtype for t in (key, value, key_cache, value_cache)])
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (key.shape[0],):
        _fail("slot_mapping", f"a [{key.shape[0]}] int32 or int64 tensor", f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if _ACTIVE is not None:
        _ACTIVE.sim.first_call("npu_scatter_pa_kv_cache")
    slots = slot_mapping.long()
    written = slots >= 0
    slots = slots[written]
    capacity = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel() and int(slots.max()) >= capacity:
        _fail("slot_mapping", f"slots in [0, {capacity - 1}] (num_blocks*block_size-1), or negative (skipped)",
              int(slots.max()))
    if slots.unique().numel() != slots.numel():
        _fail("slot_mapping", "distinct slots (重复时不保证正确性: repeated slots are not guaranteed)", "a repeated slot")
    if _ACTIVE is not None:
        _ACTIVE.writes.append(int(slots.numel()))
    key_cache.view(capacity, *key_cache.shape[2:])[slots] = key[written]
    value_cache.view(capacity, *value_cache.shape[2:])[slots] = value[written]


def _fia_max_workspace(query, key, value, **kwargs):
    """The most FIA can need for these shapes at any lengths: "获取最大workspace size" (torch_npu 2.14
    `_op_plugin_docs.py`, `_npu_fused_infer_attention_score_get_max_workspace`; the kernel source's max
    path ignores the length values). Here: the reference tiling's maximum for the query's tokens over
    every KV length the block table can hold, in the query's dtype. The lengths must still be valid."""
    kw = _fia_arguments(torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace.default._schema, kwargs)
    key4, *_ = _fia_layout(query, key, value, kw)
    kv_capacity = kw["block_table"].shape[1] * key4.shape[1]
    nbytes = tiling.max_workspace(tiling.FIA, tiling.AttentionShape.of(query, key4), query.shape[0], kv_capacity).nbytes
    nbytes = fia_workspace_answer(query, key4, kw, kw["sparse_mode"] == 4, False, nbytes)
    return torch.empty(-(-nbytes // query.element_size()), dtype=query.dtype, device=query.device)


def fia_workspace_answer(query, key4, kw, band: bool, sinks: bool, reference_nbytes: int) -> int:
    """FIA's max-workspace answer (v1, or v2 with sinks) for a checked call: the reference tiling's maximum
    `reference_nbytes`, or the fake's per-form size (`FakeNpu.fia_workspace`)."""
    from tests import fake_torch_npu_sources
    mode = _ACTIVE.fia_workspace if _ACTIVE is not None else None
    if mode is None:
        return reference_nbytes
    return fake_torch_npu_sources.fia_workspace_nbytes(mode, query, key4.shape[2], kw["block_table"].shape[0],
                                                       kw["block_table"].shape[1] * key4.shape[1], band, sinks)


def fia_workspace_check(query, key4, kw, band: bool, sinks: bool, workspace: torch.Tensor) -> None:
    """A FIA call (v1, or v2 with sinks) given less workspace than its form needs is refused (`FakeNpu.fia_workspace`)."""
    from tests import fake_torch_npu_sources
    fake_torch_npu_sources.fia_workspace_refusal(_ACTIVE.fia_workspace if _ACTIVE is not None else None, query,
                                                 key4.shape[2], kw["block_table"].shape[0],
                                                 kw["block_table"].shape[1] * key4.shape[1], band, sinks, workspace)


_LIBRARIES: list[torch.library.Library] = []


def _fake_defines(schema_text: str) -> bool:
    """Whether the fake defines this fixture line's op: ours calls FIA's `.out` overloads and the queries only,
    so the two FIA functional overloads are left undefined."""
    return not schema_text.startswith(("npu_fused_infer_attention_score(", "npu_fused_infer_attention_score_v2("))


def schema_mismatches(version: str) -> list[str]:
    """The ops of `version`'s fixture whose schema is not the one defined in this process (torch's op registry
    holds one schema per op, defined once from `VERSION`'s fixture by `_define_ops`), each as `ns::op.overload`."""
    wrong = []
    for section, ns in (("schema atb", "atb"), ("schema npu", "npu")):
        for text in filter(_fake_defines, read_fixture(version)[section]):
            schema = torch._C.parse_schema(text)
            overload = schema.overload_name or "default"
            defined = getattr(getattr(getattr(torch.ops, ns), schema.name, None), overload, None)
            if defined is None or str(defined._schema) != f"{ns}::{schema}":
                wrong.append(f"{ns}::{schema.name}.{overload}")
    return wrong


def _define_ops() -> None:
    """Define the kernels from the fixture's schemas (once per process)."""
    if _LIBRARIES:
        return
    if hasattr(torch.ops.atb, "_npu_paged_attention") or hasattr(torch.ops.npu, "npu_fused_infer_attention_score"):
        pytest.skip("a real torch_npu is loaded in this process: the fake would shadow its ops")
    atb, npu = torch.library.Library("atb", "DEF"), torch.library.Library("npu", "DEF")
    _LIBRARIES.extend((atb, npu))
    sections = read_fixture(VERSION)
    for text in sections["schema atb"]:
        atb.define(text)
    for text in filter(_fake_defines, sections["schema npu"]):
        npu.define(text)
    atb.impl("_npu_paged_attention", _pa, "CPU")
    atb.impl("_npu_paged_attention_get_workspace", _pa_workspace, "CPU")
    npu.impl("npu_fused_infer_attention_score.out", _fia_out, "CPU")
    npu.impl("npu_fused_infer_attention_score.out", _fia_out_meta, "Meta")
    npu.impl("_npu_fused_infer_attention_score_get_max_workspace", _fia_max_workspace, "CPU")
    npu.impl("npu_scatter_pa_kv_cache", _scatter_pa_kv_cache, "CPU")
    aten = torch.library.Library("aten", "IMPL")
    _LIBRARIES.append(aten)
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose
        warnings.simplefilter("ignore")
        aten.impl("multinomial", _multinomial, "CPU")
    from tests import fake_torch_npu_mla

    fake_torch_npu_mla.register(npu)


class HostReads:
    """Records the host reads of tensor data issued while it is active: `.item()`, `int(t)`, `bool(t)`
    (`_local_scalar_dense`), ops whose output shape depends on data (a boolean-mask index, `nonzero`)
    and `.tolist()` / `.numpy()`. A device graph cannot record any of them, so a binding of a device
    kernel must issue none; the kernels' own work runs below the dispatcher's view and is not seen.
    `reads` lists what was read, by op name."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self._modes = (_HostReadDispatch(self.reads), _HostReadFunction(self.reads))

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _HostReadDispatch(TorchDispatchMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class _HostReadFunction(TorchFunctionMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.reads.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class AllocatedBytes(TorchDispatchMode):
    """Counts the device memory ops allocate while it is active (every output tensor on new storage,
    a kernel's own scratch aside): `peak` bytes alive at once, `total` bytes ever allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.total = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for out in pytree.tree_leaves(result):
            if isinstance(out, torch.Tensor):
                self._count(out.untyped_storage())
        return result

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._seen or not storage.nbytes():
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.total += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


# ----------------------------------------------------------------------------- the device


@dataclasses.dataclass
class Call:
    """One call our code made to a torch_npu function: its name and arguments as passed."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class FakeNpu:
    """The state of one installed fake: the simulator, streams, launches, and a log of calls."""

    def __init__(self, device_kernels: tuple[str, ...], version: str = VERSION) -> None:
        self.release = release(version)
        self.sim = SimRuntime(device_kernels=device_kernels)
        pa, fia = torch.ops.atb._npu_paged_attention, torch.ops.npu.npu_fused_infer_attention_score
        self.sim.zero_length_fast_path(pa, "context_lens")
        self.sim.zero_length_fast_path(fia, "actual_seq_lengths_kv")
        self.sim.zero_length_fast_path(torch.ops.npu.npu_fused_infer_attention_score_v2, "actual_seq_kvlen")
        # one branch for S=1, another for S>1 (`_op_plugin_docs.py` L8056, L8580): SimRuntime.query_length_branches
        self.sim.query_length_branches(fia, "actual_seq_lengths")
        self.sim.query_length_branches(torch.ops.npu.npu_fused_infer_attention_score_v2, "actual_seq_qlen")
        self.sim.copies_host_inputs(pa, "context_lens")
        self.calls: list[Call] = []
        self.executed: list[tuple[str, tuple[int, ...]]] = []  # (kernel, KV lengths) of each execution
        self.writes: list[int] = []  # slots written by each execution of npu_scatter_pa_kv_cache
        self.trace: list[tuple[str, Any]] = []  # (what, stream) of every graph-API call, in order
        self.pools: list[Any] = []
        self.capturing: Any = None  # the capture stream while a capture is open
        self.batches = TaskBatches()  # FIA's batch and block table at capture and each update
        self.ids = itertools.count()
        self.default_stream: Stream | None = None
        self.streams: list[Stream] = []
        #: The NPU's default generator (`torch.npu.default_generators[0]`), apart from the CPU's as
        #: torch_npu's `NPUGeneratorImpl` is: the device's random kernels draw from it (`_multinomial`).
        self.generator = torch.Generator()
        #: Whether FIA's band applies to a call whose every sequence has one query token: False as the docs
        #: say ("Q_S为1时该参数无效", L8110), True as vLLM-Ascend's decode graphs rely on
        #: (`tests/fake_torch_npu_features.py`).
        self.band_at_single_query = False
        #: How many keys a band of pre_tokens P attends: "docs" P + 1 (L1636-1645, L8200), "vllm-ascend" P
        #: (its pre_tokens = W, attention_v1.py L942), "neither" P + 2 (`tests/fake_torch_npu_features.py`).
        self.band_reading = "docs"
        #: The FIA kernel source whose TND rules the fake plays: None (the docs' only), "c29bc106" or "bfbbec83"
        #: (`tests/fake_torch_npu_sources.py`).
        self.kernel_source: str | None = None
        #: How FIA's workspace query answers and its kernel checks the workspace given: None (the reference tiling,
        #: every form alike), "c29bc106" or "per-form" (`tests/fake_torch_npu_sources.py`, `fia_workspace_nbytes`).
        self.fia_workspace: str | None = None

    def log(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.batches.issued(name, kwargs, self.capturing is not None)
        with _disable_current_modes():  # not a device op: nothing for a capture or update to record
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        self.calls.append(Call(name, args, kwargs))
        self.trace.append((name, self.current()))

    def count(self, *names: str) -> int:
        """How many calls were made to any of `names`."""
        return sum(c.name in names for c in self.calls)

    def current(self) -> "Stream":
        return self.streams[-1] if self.streams else self.default_stream

    def synchronize(self) -> None:
        """The host waits for the device: every stream drains."""
        self.trace.append(("synchronize", None))
        self.sim.synchronize()


_ACTIVE: FakeNpu | None = None


def _fake() -> FakeNpu:
    if _ACTIVE is None:
        raise RuntimeError("fake torch_npu: not installed (use the fake_npu fixture)")
    return _ACTIVE


#: The cores a stream may use until `set_stream_limit` says otherwise (an Atlas A2's AI cube and vector
#: cores; any value would do).
DEVICE_CORES = {"cube_core_num": 24, "vector_core_num": 48}


class Stream:
    """`torch.npu.Stream`: an ordered queue of device work, with the core limit of its kernels."""

    def __new__(cls, device=None, priority=0, **kwargs):
        self = super().__new__(cls)
        self.device, self.priority, self.stream_id = device, priority, next(_fake().ids)
        self.sim = _fake().sim.new_stream(f"npu stream {self.stream_id}", priority)
        self.core_limit = dict(DEVICE_CORES)
        return self

    def wait_event(self, event):
        event.wait(self)

    def __repr__(self) -> str:
        return f"<fake torch_npu.npu.Stream {self.stream_id} priority={self.priority}>"


class Event:
    """`torch.npu.Event`: marks a point of a stream's work."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        self = super().__new__(cls)
        self.sim = _fake().sim.event("Event", external=False)
        return self

    def record(self, stream=None):
        self.sim.record((stream or _fake().current()).sim)

    def wait(self, stream=None):
        self.sim.wait((stream or _fake().current()).sim)

    def query(self):
        """Whether the device has passed the record (never waits)."""
        return self.sim.recorded


class ExternalEvent:
    """`torch.npu.ExternalEvent`: waited on inside a graph, recorded from outside it."""

    _count = itertools.count()

    def __new__(cls):
        self = super().__new__(cls)
        self.sim = _fake().sim.event(f"ExternalEvent{next(cls._count)}")
        return self

    def record(self, stream=None):
        _fake().trace.append(("ExternalEvent.record", stream))
        self.sim.record((stream or _fake().current()).sim)

    def wait(self, stream=None):
        _fake().trace.append(("ExternalEvent.wait", stream))
        self.sim.wait((stream or _fake().current()).sim)

    def reset(self, stream=None):
        _fake().trace.append(("ExternalEvent.reset", stream))
        self.sim.reset((stream or _fake().current()).sim)


class _NPUTaskGroupHandle:
    """`torch_npu._C._NPUTaskGroupHandle`, with the core limit its kernels were tiled for."""

    def __init__(self, task_group: Any, core_limit: dict[str, int], fia_calls: list | None = None) -> None:
        self.task_group = task_group
        self.core_limit = core_limit
        self.fia_calls = fia_calls or []  # (entries, block table) of its FIA calls at capture


class NPUGraph:
    """`torch.npu.NPUGraph` over a simulator graph."""

    def __init__(self):
        self.sim = _fake().sim.graph()
        self._ctx = None
        self._pool = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode: expected global, thread_local or relaxed, got {capture_error_mode!r}")
        fake = _fake()
        self._pool = pool if pool is not None else graph_pool_handle()
        fake.pools.append(self._pool)
        self._ctx = self.sim.capture()
        self._ctx.__enter__()
        fake.capturing = fake.current()

    def capture_end(self):
        self._finish(None, None, None)

    def _finish(self, exc_type, exc, tb) -> None:
        ctx, self._ctx = self._ctx, None
        _fake().capturing = None
        ctx.__exit__(exc_type, exc, tb)

    def replay(self):
        """Queue the graph on the current stream. A graph with no task group (a piece: its host
        lengths are none) then runs at once: the eager ops the host issues after it would queue
        behind it on the device, and the fake runs those on the host as they come."""
        fake = _fake()
        fake.trace.append(("replay", fake.current()))
        self.sim.replay(fake.current().sim)
        if not self.sim.recording.groups:
            fake.sim.run_stream(fake.current().sim)

    def pool(self):
        return self._pool


class graph:  # noqa: N801 - the real name
    """`torch.npu.graph`: capture into `npu_graph` on `stream` (a side stream by default)."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode: str = "global"):
        if auto_dispatch_capture:
            raise NotImplementedError("auto_dispatch_capture: the fake does not implement torch_npu's auto dispatch")
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_stream = stream if stream is not None else Stream()
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        fake = _fake()
        # torch_npu/npu/graphs.py, graph.__enter__: synchronize, empty_cache, and from 2.14.0 on host_empty_cache
        fake.synchronize()
        empty_cache()
        if fake.release.graph_enter_empties_host_cache:
            host_empty_cache()
        fake.streams.append(self.capture_stream)
        try:
            self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            fake.streams.pop()
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        fake = _fake()
        try:
            self.npu_graph._finish(exc_type, exc_value, traceback)
        finally:
            fake.streams.pop()


def graph_pool_handle():
    return ("pool", next(_fake().ids))


def graph_task_group_begin(stream):
    fake = _fake()
    if fake.capturing is None or stream is not fake.capturing:
        raise RuntimeError(f"graph_task_group_begin: {stream!r} is not capturing")
    fake.trace.append(("graph_task_group_begin", stream))
    fake.sim.task_group_begin()
    fake.batches.group_begin()


def graph_task_group_end(stream):
    fake = _fake()
    if fake.capturing is None or stream is not fake.capturing:
        raise RuntimeError(f"graph_task_group_end: {stream!r} is not capturing")
    fake.trace.append(("graph_task_group_end", stream))
    return _NPUTaskGroupHandle(fake.sim.task_group_end(), dict(stream.core_limit), fake.batches.group_end())


def graph_task_update_begin(stream, handle):
    """A task update re-tiles its kernel on the host for the cores of the stream it is issued on; a
    stream limited otherwise than the capture's would re-tile the task for another core count, so the
    fake refuses it (npugraph_ex sets the update stream's limit to the one captured before every update:
    torch_npu 2.14 `npugraph_ex/_acl_concrete_graph/acl_graph.py`, `set_stream_limit` before
    `graph_task_update_begin`; the limit recorded at capture in `fx2acl_converter.py`)."""
    fake = _fake()
    if stream is fake.capturing:
        raise RuntimeError("graph_task_update_begin: the stream is capturing")
    if stream.core_limit != handle.core_limit:
        raise RuntimeError(
            f"graph_task_update_begin: the update stream's core limit {stream.core_limit} differs from the "
            f"{handle.core_limit} the task was captured with: the update would tile it for other cores"
        )
    fake.trace.append(("graph_task_update_begin", stream))
    fake.sim.task_update_begin(handle.task_group, stream.sim)
    fake.batches.update_begin(handle.fia_calls)


def graph_task_update_end(stream):
    fake = _fake()
    fake.trace.append(("graph_task_update_end", stream))
    fake.sim.task_update_end()
    fake.batches.update_end()


def synchronize(device=None):
    _fake().synchronize()


def empty_cache():
    """Releases the caching allocator's unused blocks (nothing to release on the fake's CPU)."""
    _fake().trace.append(("empty_cache", None))


def host_empty_cache():
    """Releases the host allocator's unused pinned blocks (nothing to release on the fake's CPU)."""
    _fake().trace.append(("host_empty_cache", None))


def get_stream_limit(stream):
    return dict(stream.core_limit)


def set_stream_limit(stream, cube_num=-1, vector_num=-1):
    _fake().trace.append(("set_stream_limit", stream))
    if cube_num != -1:
        stream.core_limit["cube_core_num"] = cube_num
    if vector_num != -1:
        stream.core_limit["vector_core_num"] = vector_num


def current_stream(device=None):
    return _fake().current()


@contextlib.contextmanager
def stream(stream):  # noqa: F811 - the real name
    if stream is None:
        yield
        return
    fake = _fake()
    fake.streams.append(stream)
    try:
        yield
    finally:
        fake.streams.pop()


def current_device():
    return 0


def get_rng_state(device="npu"):
    """`torch_npu/npu/random.py: get_rng_state`: the state of the NPU's default generator, which is
    not the CPU's (`FakeNpu.generator`)."""
    return _fake().generator.get_state()


def set_rng_state(new_state, device="npu"):
    """`torch_npu/npu/random.py: set_rng_state`: the NPU's default generator's state."""
    _fake().generator.set_state(new_state)


def manual_seed_all(seed):
    """`torch_npu/npu/random.py: manual_seed_all`, which `torch.manual_seed` calls for the NPU
    (torch's `_seed_custom_device`, torch_npu naming the privateuse1 backend "npu"): `install`
    makes `torch.manual_seed` call it too."""
    _fake().generator.manual_seed(int(seed))


def manual_seed(seed):
    """`torch_npu/npu/random.py: manual_seed`: the current NPU's generator (the fake has one NPU)."""
    _fake().generator.manual_seed(int(seed))


def _is_in_bad_fork():
    return False


def _multinomial(self, num_samples, replacement=False, *, generator=None):
    """The CPU kernel of `aten::multinomial` while the fake is loaded: the fake's device is the CPU,
    and its random kernel draws from the NPU's generator unless given one, as a sampler's
    `torch.multinomial` on an NPU tensor does on the device. With no fake installed, the CPU's,
    as torch's own kernel (whose draws the `.out` overload's are)."""
    if generator is None and _ACTIVE is not None:
        generator = _ACTIVE.generator
    out = torch.empty(self.shape[:-1] + (num_samples,), dtype=torch.long, device=self.device)
    return torch.ops.aten.multinomial.out(self, num_samples, replacement, generator=generator, out=out)


def is_available():
    return True


def device_count():
    return 1


def _weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """`torch_npu._C._weak_ref_tensor`: the same memory, sizes and strides, owning nothing."""
    with _disable_current_modes():
        storage = t.untyped_storage()
        weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


class _Packet:
    """An op packet of torch_npu whose overloads log how they are called."""

    def __init__(self, name: str, packet: Any, overloads: tuple[str, ...]) -> None:
        for overload in overloads:
            setattr(self, overload, _logged(f"{name}.{overload}", getattr(packet, overload)))


def _logged(name: str, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        _fake().log(name, args, kwargs)
        return fn(*args, **kwargs)

    call.__name__ = name
    return call


NPU_FUNCTIONS = (
    Stream, Event, ExternalEvent, NPUGraph, graph, graph_pool_handle, graph_task_group_begin,
    graph_task_group_end, graph_task_update_begin, graph_task_update_end, synchronize, current_stream,
    stream, current_device, is_available, device_count, get_rng_state, set_rng_state, manual_seed, manual_seed_all,
    _is_in_bad_fork, empty_cache, host_empty_cache, get_stream_limit, set_stream_limit,
)


#: The torch_npu ops the fake offers, as `torch_npu` attributes: name -> (namespace, overloads it logs;
#: None: the op itself, logged as a function). Each is offered where the version's fixture has its schemas.
TORCH_NPU_OPS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "_npu_paged_attention": ("atb", None),
    "_npu_paged_attention_get_workspace": ("atb", None),
    "npu_fused_infer_attention_score": ("npu", ("out",)),
    "_npu_fused_infer_attention_score_get_max_workspace": ("npu", None),
    "npu_fused_infer_attention_score_v2": ("npu", ("out",)),
    "_npu_fused_infer_attention_score_v2_get_max_workspace": ("npu", None),
    "npu_scatter_pa_kv_cache": ("npu", None),
}
#: `torch_npu._C` names the fake offers where the version's fixture lists them.
C_NAMES = {"_weak_ref_tensor": _weak_ref_tensor, "_NPUTaskGroupHandle": _NPUTaskGroupHandle}


def _npu_module(fake: FakeNpu, version: str) -> types.ModuleType:
    """`torch_npu.npu` (= `torch.npu`) of `version`: the fake's functions its fixture lists."""
    npu = types.ModuleType("torch_npu.npu")
    listed = python_names(version)
    for fn in NPU_FUNCTIONS:
        if fn.__name__ in listed:
            setattr(npu, fn.__name__, fn)
    npu.default_generators = (fake.generator,)
    return npu


def _c_module(version: str) -> types.ModuleType:
    """`torch_npu._C` of `version`: the names its fixture lists."""
    c = types.ModuleType("torch_npu._C")
    for name in read_fixture(version).get("names torch_npu._C", ()):
        setattr(c, name, C_NAMES[name])
    return c


def _op_exports(version: str) -> dict[str, Any]:
    """The `torch_npu` attributes of the ops `version`'s fixture has (every overload the fake logs), logged."""
    have = schemas(version)
    exports = {}
    for name, (ns, overloads) in TORCH_NPU_OPS.items():
        packet = getattr(getattr(torch.ops, ns), name)
        if overloads is None and name in have:
            exports[name] = _logged(name, packet)
        elif overloads is not None and all(f"{name}.{o}" in have for o in overloads):
            exports[name] = _Packet(name, packet, overloads)
    return exports


def install(
    monkeypatch: pytest.MonkeyPatch, device_kernels: tuple[str, ...] = DEVICE_KERNELS,
    band_at_single_query: bool | str = False, band_reading: str = "docs", version: str = VERSION,
    fia_workspace: str | None = None,
) -> FakeNpu:
    """Install a fresh fake as `torch_npu` and `torch.npu` until the test ends; returns its state.
    `device_kernels`: the ops besides torch's own that its simulator records as one task each;
    `band_at_single_query`: FIA's band applied at one query token per sequence too (`FakeNpu`), or "broken" / "refused"
    (`tests/fake_torch_npu_features.py`: a band of the wrong width there, or the device's refusal);
    `fia_workspace`: how FIA's workspace is sized per form (`FakeNpu.fia_workspace`);
    `band_reading`: how many keys a band of pre_tokens P attends ("docs" P + 1, "vllm-ascend" P, "neither");
    `version`: the torch_npu release played (`VERSIONS`): only what its fixture lists is offered, and its ops
    must have the schemas defined in this process (one per op: a version whose schemas differ is refused).

    Its device is the CPU, so NPU tensors are CPU tensors: `NPU_DEVICE_TYPE` reads "cpu" meanwhile.
    """
    release(version)
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed: tests never import it, and the fake would shadow it")
    _define_ops()
    wrong = schema_mismatches(version)
    if wrong:
        raise RuntimeError(f"fake torch_npu {version}: {', '.join(wrong)} differ from the schemas defined in this "
                           f"process ({VERSION}'s): torch's op registry holds one schema per op")
    fake = FakeNpu(device_kernels, version)
    fake.band_at_single_query = band_at_single_query
    fake.band_reading = band_reading
    fake.fia_workspace = fia_workspace
    monkeypatch.setattr(sys.modules[__name__], "_ACTIVE", fake)
    fake.default_stream = Stream()

    npu, c = _npu_module(fake, version), _c_module(version)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__version__ = version
    torch_npu.npu = npu
    torch_npu._C = c
    for name, export in _op_exports(version).items():
        setattr(torch_npu, name, export)
    for name, module in (("torch_npu", torch_npu), ("torch_npu.npu", npu), ("torch_npu._C", c)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(torch.random, "_seed_custom_device", manual_seed_all)  # torch.manual_seed seeds the NPU
    monkeypatch.setattr(runtime_npu, "NPU_DEVICE_TYPE", "cpu")
    return fake
