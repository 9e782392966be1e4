"""The NPU target's checks of a graph against the torch_npu kernels' documented constraints.

At compile time (`check_npu_graph`) every kernel node and KV-cache write of a rewritten graph is held
to `ops/npu/rules.py`: PA's and FIA's block sizes and half-precision dtypes, MLA's shape rules (FIA v2's MLA form: d 512, rope
64, power-of-two query heads up to 128, blocks of 16 or 128, half precision, at most 4096 sequences),
contiguous caches, and enough cache blocks for FIA and MLA to count one per sequence of each bucket's
all-padding capture (`padding.capture_kv_lens`), and the attention features: sinks held to FIA v2's
`learnable_sink` rules, a soft-cap refused (`REFUSED_FEATURES`; a window is FIA's band mode,
`ops/npu/features.py`), FIA's TND head dim and the 4096 sequences a TND call may hold (the kernel source's).
A violation is refused before torch_npu is called, naming the layer, the kernel and the rule: on a device
it would fail at the first capture, or worse, run with a copy of the whole cache per call. Last, each FIA
layer's form is asked of the device's kernel once (`ops/npu/form_probe.py`: where CANN versions differ) and
refused, naming the layer and the device's message, where the device refuses it (under `refused_layers="eager"`
returned instead: its layer is served eagerly, `passes/pipeline.py`). Each step (`npu_step_guard`), FIA's and MLA's block count is checked on the padded
lengths the step would send, and MLA's query lengths (1-16 per sequence, and the sparse mode the
graph was captured with: 0 in a decode graph, 3 in a mixed one), and PA's workspace need at those
lengths against its slot (`pa_workspace_guard`), and, where the device's S=1 band probe finds FIA's band
not applied at one query token per sequence, a windowed layer's decode steps past its window
(`window_guard`, `ops/npu/band_probe.py`); a step failing any runs eagerly.
A mixed step with a sequence of more than 16 query tokens (a prefill chunk) is such a step: refusing
it at compile time would refuse every model that prefills, and vLLM-Ascend runs those steps outside
its graphs too (FULL_DECODE_ONLY).
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import fx

from ..errors import AscendCompileError
from ..ops import tiling
from ..ops.npu import api as npu_api, band_probe as npu_band_probe, features as npu_features, rules as npu_rules
from .fx_utils import example_value, is_op
from .kernel_call import HostSource, KernelCall, StepGuard, is_kernel, kernel_calls
from .padding import capture_kv_lens, dummy_limit, packed_capture
from .probe import WorkspaceQueries
from .workspaces import WORKSPACE_BYTES_KEY, GraphKey

#: The KV lengths of the all-padding capture of a key's graph.
CaptureLens = Callable[[GraphKey], Sequence[int]]
#: Why the device's FIA refuses a layer of (shape, dtype, window, sinks), or None (`ops/npu/form_probe.refusal`).
FormRefusal = Callable[[tiling.AttentionShape, torch.dtype, "int | None", bool], "str | None"]


def layer_of(node: fx.Node) -> str:
    """A node's name and, where dynamo recorded it, the module it was traced in."""
    adapted = node.meta.get("ascend_adapted_from")
    stack = node.meta.get("nn_module_stack")
    where = adapted or (list(stack.values())[-1][0] if stack else None)
    return f"{node.name} (layer {where})" if where else node.name


def _refuse(node: fx.Node, check: Callable[[], None]) -> None:
    try:
        check()
    except ValueError as err:
        raise ValueError(f"{layer_of(node)}: {err}") from None


#: The attention features (`ops/features.py`) runtime "npu" refuses, and why. A window and sinks are
#: served as vLLM-Ascend serves them (FIA's band mode, FIA v2's `learnable_sink`: `ops/npu/features.py`).
REFUSED_FEATURES = {"soft_cap": npu_features.SOFT_CAP_REFUSAL}


def _check_features(call: KernelCall, keys: Sequence[GraphKey]) -> None:
    """A layer with a feature the torch_npu binding does not take, refused naming the layer and the feature;
    sinks held to FIA v2's `learnable_sink` rules (`npu_rules.check_sinks`, at most 4096 sequences a call)."""
    features = call.meta.features
    for name in features.names():
        if name in REFUSED_FEATURES:
            raise ValueError(f"{layer_of(call.node)}: {name} is not supported on runtime 'npu': {REFUSED_FEATURES[name]}")
    if features.sinks:
        query, sinks, shape = example_value(call.arg("query")), example_value(call.arg("sinks")), call.meta.shape
        _refuse(call.node, lambda: npu_rules.check_sinks(query.dtype, sinks.dtype, tuple(sinks.shape), shape.num_heads,
                                                         shape.head_dim))
        for key in keys:  # "actual_seq_qlen和actual_seq_kvlen的元素个数不大于4096" (L8738, this form's section)
            _refuse(call.node, lambda: npu_rules.check_mla_sequences(key.bucket, npu_rules.SINKS_KERNEL))


def _check_mla(call: KernelCall, keys: Sequence[GraphKey], capture_lens: CaptureLens) -> None:
    """FIA v2's MLA form: the layer's shape and dtype, contiguous caches, the sequences and blocks of each
    bucket's capture."""
    args = call.args()
    shape = call.meta.shape
    dtype = example_value(args["q_nope"]).dtype
    caches = {name: example_value(args[name]) for name in ("kv_c_cache", "k_pe_cache")}
    _refuse(call.node, lambda: npu_rules.check_mla_shape(shape.num_heads, shape.head_dim, shape.rope_dim,
                                                          shape.block_size, dtype))
    _refuse(call.node, lambda: npu_rules.check_contiguous(npu_rules.MLA_KERNEL, caches))
    num_blocks = caches["kv_c_cache"].shape[0]
    for key in keys:
        _refuse(call.node, lambda: npu_rules.check_mla_sequences(key.bucket))
        if isinstance(num_blocks, int):
            _refuse(call.node, lambda: _check_capture_blocks(num_blocks, key.bucket, capture_lens(key),
                                                             shape.block_size, npu_rules.MLA_KERNEL, "kv_c_cache"))


def _check_kernel(call: KernelCall, keys: Sequence[GraphKey], capture_lens: CaptureLens,
                  form_refusal: FormRefusal | None = None, eager_refused: bool = False) -> str | None:
    """Refuse `call` where a rule does; where the device refuses its form: refused too, or with
    `eager_refused` the refusal returned (the layer is then served eagerly)."""
    _check_features(call, keys)
    if call.meta.kernel == tiling.MLA:
        _check_mla(call, keys, capture_lens)
        return None
    args = call.args()
    key_cache, value_cache = example_value(args["key_cache"]), example_value(args["value_cache"])
    block_size = call.meta.shape.block_size
    shape = call.meta.shape
    if call.meta.kernel == tiling.PA:
        kernel = npu_rules.PA_KERNEL
        _refuse(call.node, lambda: npu_rules.check_pa_block_size(block_size))
        _refuse(call.node, lambda: npu_rules.check_pa_head_size(shape.head_dim))
    else:
        kernel = npu_rules.FIA_KERNEL
        _refuse(call.node, lambda: npu_rules.check_fia_block_size(block_size))
        _refuse(call.node, lambda: npu_rules.check_fia_heads(shape.num_heads, shape.num_kv_heads, shape.head_dim))
        for key in keys:  # a graph's calls hold at most as many sequences as its key has tokens
            _refuse(call.node, lambda: npu_rules.check_tnd_sequences(key.bucket))
    _refuse(call.node, lambda: npu_rules.check_contiguous(kernel, {"key_cache": key_cache, "value_cache": value_cache}))
    query = example_value(args["query"])
    _refuse(call.node, lambda: npu_rules.check_attention_dtype(kernel, query.dtype, key_cache.dtype))
    if call.meta.kernel == tiling.FIA and isinstance(key_cache.shape[0], int):
        for key in keys:  # captured all padding (`padding.capture_kv_lens`)
            _refuse(call.node, lambda: _check_capture_blocks(key_cache.shape[0], key.bucket, capture_lens(key),
                                                             block_size))
    if call.meta.kernel == tiling.FIA and form_refusal is not None:  # what only the device can say, asked last
        why = form_refusal(shape, query.dtype, call.meta.features.window, bool(call.meta.features.sinks))
        if why:
            why = f"{layer_of(call.node)}: {kernel} does not take this layer on this device: {why}"
            if not eager_refused:
                raise ValueError(why)
            return why
    return None


def _check_capture_blocks(num_blocks: int, bucket: int, lens: Sequence[int], block_size: int,
                          kernel: str = npu_rules.FIA_KERNEL, cache: str = "key_cache") -> None:
    try:
        npu_rules.check_fia_num_blocks(num_blocks, lens, block_size, kernel, cache)
    except ValueError as err:
        raise ValueError(f"{err}; bucket {bucket} is captured with {len(lens)} padding sequences: lower "
                         f"capture_sizes or allocate more blocks") from None


#: The cache writes bound to `npu_scatter_pa_kv_cache`, and the names of their caches (arguments 2 and 3).
CACHE_WRITES = {torch.ops.ascend.reshape_and_cache: ("key_cache", "value_cache"),
                torch.ops.ascend.mla_cache_write: ("kv_c_cache", "k_pe_cache")}


def check_npu_graph(gm: fx.GraphModule, keys: Sequence[GraphKey], mixed_graph_kernels: frozenset[str],
                    api_absent: Collection[npu_api.Api] = frozenset(), torch_npu_version: str = "",
                    form_refusal: FormRefusal | None = None, eager_refused: bool = False) -> dict[str, str]:
    """Refuse what the torch_npu kernels cannot run in `gm`, a rewritten graph serving `keys` (a key of
    a kernel in `mixed_graph_kernels` has a mixed graph of its own: `padding.packed_capture`), a node
    whose binding calls a function of `api_absent`, what the installed torch_npu (`torch_npu_version`) lacks
    (`ops/npu/api.py`), and, given `form_refusal` (the device's form probe), a FIA layer whose form the
    device's kernel refuses (`ops/npu/form_probe.py`); with `eager_refused` such a layer is not refused but
    returned: its attention node's name -> the refusal (the layer is served eagerly)."""
    limit = dummy_limit(gm)
    eager: dict[str, str] = {}

    def capture_lens(key: GraphKey) -> Sequence[int]:
        return capture_kv_lens(key.bucket, packed_capture(gm, key, mixed_graph_kernels), limit)

    for node in gm.graph.nodes:
        if is_kernel(node):
            call = KernelCall.of(node)
            _check_api(node, npu_api.kernel_api(call.meta.kernel, bool(call.meta.features.sinks)), api_absent,
                       torch_npu_version)
            why = _check_kernel(call, keys, capture_lens, form_refusal, eager_refused)
            if why:
                eager[call.meta.attention] = why
        else:
            for op, names in CACHE_WRITES.items():
                if is_op(node, op):
                    _check_api(node, npu_api.CACHE_WRITE_API, api_absent, torch_npu_version)
                    caches = dict(zip(names, (example_value(n) for n in node.args[2:4])))
                    _refuse(node, lambda: npu_rules.check_contiguous(npu_rules.CACHE_WRITE_KERNEL, caches))
    return eager


def _check_api(node: fx.Node, needed: Sequence[npu_api.Api], absent: Collection[npu_api.Api], version: str) -> None:
    """Refuse `node`, naming its layer, where the installed torch_npu lacks a function its binding calls."""
    why = npu_api.refusal(needed, absent, version)
    if why:
        raise AscendCompileError(f"{layer_of(node)}: {why}")


#: The KV-length argument and cache of each kernel FIA's block count applies to.
_BLOCK_COUNTED = {tiling.FIA: ("actual_seq_lengths_kv", "key_cache"), tiling.MLA: ("actual_seq_kvlen", "kv_c_cache")}


def npu_step_guard(gm: fx.GraphModule, key: GraphKey, pa_queries: Callable[[torch.dtype], WorkspaceQueries] | None,
                   max_model_len: int, band_at_single_query: Callable[[npu_band_probe.BandForm], bool] | None = None
                   ) -> StepGuard | None:
    """The length checks of each step (`length_guard`), given `pa_queries` (the device's workspace
    queries on probe tensors of a dtype) PA's workspace need at the step's lengths (`pa_workspace_guard`),
    and given `band_at_single_query` (the device's S=1 band probe) the windowed layers' decode steps
    (`window_guard`)."""
    guards = [length_guard(gm, key), pa_workspace_guard(gm, key, pa_queries, max_model_len) if pa_queries else None,
              window_guard(gm, band_at_single_query) if band_at_single_query else None]
    guards = [g for g in guards if g is not None]
    if len(guards) <= 1:
        return guards[0] if guards else None
    return lambda host, args: next((why for why in (g(host, args) for g in guards) if why), None)


def _source(call: KernelCall, kernel_arg: str) -> HostSource:
    return next(a.source for a in call.meta.host_args if a.kernel_arg == kernel_arg)


def windowed_fia_layers(gm: fx.GraphModule) -> dict[str, tuple[int, npu_band_probe.BandForm, HostSource, HostSource]]:
    """Each windowed FIA layer of `gm`: its node's name -> (window, its band form, query-ends source, KV-lengths
    source)."""
    return {call.node.name: (call.meta.features.window,
                             npu_band_probe.form(call.meta.shape, example_value(call.arg("query")).dtype,
                                                 bool(call.meta.features.sinks)),
                             _source(call, "actual_seq_lengths"), _source(call, "actual_seq_lengths_kv"))
            for call in kernel_calls(gm)
            if call.meta.kernel == tiling.FIA and call.meta.features.window is not None}


def window_guard(gm: fx.GraphModule, band_at_single_query: Callable[[npu_band_probe.BandForm], bool]
                 ) -> StepGuard | None:
    """A check of each step for `gm`'s windowed FIA layers on a device that does not apply FIA's band when
    every sequence has one query token (`band_at_single_query`, the device's probe, asked here for the
    layers' forms: `ops/npu/band_probe.py`); None where it does, or without such layers. A decode step
    (every sequence one query token: the docs' IncreFlashAttention branch, L8056, where "Q_S为1时该参数无效" of
    `pre_tokens`, torch_npu 2.14 `_op_plugin_docs.py` L8110) with a sequence longer than a layer's window
    runs eagerly, through the model's own attention: the graph would attend the whole context."""
    layers = {name: layer for name, layer in windowed_fia_layers(gm).items() if not band_at_single_query(layer[1])}
    if not layers:
        return None

    def guard(host: Mapping[HostSource, list[int]], args: Sequence[Any]) -> str | None:
        for name, (window, _, ends, kv_lens) in layers.items():
            if npu_band_probe.single_query_outside(host[ends], host[kv_lens], window):
                return (f"{name}: a decode step with a sequence longer than the layer's window of {window}, whose "
                        f"band FIA would not apply: {npu_band_probe.REFUSAL}")
        return None

    return guard


def length_guard(gm: fx.GraphModule, key: GraphKey) -> StepGuard | None:
    """A check of each step's padded lengths for `gm`, captured as `key`'s graph, or None where no
    kernel needs one: FIA's and MLA's block count ("blocknum不能小于...": real sequences hold their own
    blocks and each padding sequence counts one more, so a step near a full cache exceeds it), and
    MLA's query lengths (`npu_rules.mla_step_refusal`: at most 16 per sequence, and the sparse mode of
    the graph's capture, 0 for a decode graph and 3 for a mixed one: a captured task keeps its call's mode; a
    piecewise key's kernels run eagerly, each call in the mode of its own lengths, so none there). A refused
    step runs eagerly."""
    limits, queries = {}, {}
    for call in kernel_calls(gm):
        if call.meta.kernel not in _BLOCK_COUNTED:
            continue
        kv_arg, cache = _BLOCK_COUNTED[call.meta.kernel]
        num_blocks = example_value(call.arg(cache)).shape[0]
        if isinstance(num_blocks, int):
            source = next(a.source for a in call.meta.host_args if a.kernel_arg == kv_arg)
            limits[(source, call.meta.shape.block_size, num_blocks)] = call.node.name
        if call.meta.kernel == tiling.MLA:
            queries[next(a.source for a in call.meta.host_args if a.kernel_arg == "actual_seq_qlen")] = call.node.name
    if not limits and not queries:
        return None
    sparse_mode = None if key.piecewise else 0 if key.decode else 3

    def guard(host: Mapping[HostSource, list[int]], args: Sequence[Any]) -> str | None:
        for (source, block_size, num_blocks), name in limits.items():
            if npu_rules.fia_block_count(host[source], block_size) > num_blocks:
                return (f"{name}: the step's sequences, padding included, need more than the cache's {num_blocks} "
                        f"blocks, which FIA and MLA refuse ('blocknum不能小于...的block数量之和')")
        for source, name in queries.items():
            ends = host[source]
            refusal = npu_rules.mla_step_refusal([b - a for a, b in zip([0, *ends[:-1]], ends)], sparse_mode)
            if refusal:
                return f"{name}: {refusal}"
        return None

    return guard


def pa_workspace_guard(gm: fx.GraphModule, key: GraphKey, pa_queries: Callable[[torch.dtype], WorkspaceQueries],
                       max_model_len: int) -> StepGuard | None:
    """A check of PA's workspace need at each step's padded lengths against the slot `gm`, captured
    as `key`'s graph, gives PA (each bucket's own under `share_workspace=False`), for a graph with PA
    kernels; None without. ATB does not check a workspace it is given against its need, and that
    need depends on the mix of a batch's lengths, which no compile-time question
    covers (`probe.py`): so each step's lengths are asked of `_npu_paged_attention_get_workspace`, as
    vLLM-Ascend asks at every update (`vllm_ascend/attention/utils.py`), one question per PA shape
    of the graph, and a step needing more than the slot runs eagerly instead of overrunning it.

    It asks as vLLM-Ascend does (`update_paged_attention_graph_param`): with the kernel's own caches
    and block table (the graph's arguments `args`: the KV caches in place, the graph's static block
    table), so the query sees their real shapes, and the step's `context_lens`. The block table's
    contents are the previous step's at that point (the step's are copied in at its replay): they
    cannot change the answer, ATB's tiling being host-side and `block_table` a device tensor, unlike
    `context_lens` ("Device Tensor" / "int类型数组", `_atb_api_docs.py` L258-259), which is all the
    host reads of a call (the ATB binding copies its CPU tensors, op-plugin `AtbCommon.cpp`); so layers
    whose caches and table have the same shapes are asked once, with the first one's. A cache
    or table that is not a graph input (a view the graph makes) is asked as a probe tensor of its
    shape's kind, as at compile time (a one-block cache, a table `max_model_len` wide)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    sites: dict[tuple, tuple[int, str]] = {}
    for call in kernel_calls(gm):
        if call.meta.kernel == tiling.PA:
            slot = call.workspace.meta[WORKSPACE_BYTES_KEY][str(key)]
            source = next(a.source for a in call.meta.host_args if a.kernel_arg == "context_lens")
            max_blocks = -(-max_model_len // call.meta.shape.block_size)
            dtype = example_value(call.arg("query")).dtype
            names = ("key_cache", "value_cache", "block_table")
            inputs = tuple(placeholders.get(call.arg(name)) for name in names)
            shapes = tuple(tuple(map(str, example_value(call.arg(name)).shape)) for name in names)
            # Layers of one shape get one answer (it reads no tensor values): one question for them all.
            sites.setdefault((call.meta.shape, source, max_blocks, dtype, shapes), (slot, call.node.name, inputs))
    if not sites:
        return None
    queries = {site[3]: pa_queries(site[3]) for site in sites}

    def guard(host: Mapping[HostSource, list[int]], args: Sequence[Any]) -> str | None:
        for (shape, source, max_blocks, dtype, _), (slot, name, inputs) in sites.items():
            tensors = [args[i] if i is not None else None for i in inputs]
            if queries[dtype].paged_attention(shape, host[source], max_blocks, *tensors) > slot:
                return (f"{name}: PA needs more workspace at the step's lengths than the {slot} bytes of its slot "
                        f"(sized at one length: `_npu_paged_attention_get_workspace` answers for the lengths it "
                        f"is given); pass workspace_probe_lens to size it at more lengths")
        return None

    return guard
