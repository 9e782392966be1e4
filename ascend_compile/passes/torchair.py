"""Our passes inside torchair's npugraph_ex backend, through its custom FX pass hook.

npugraph_ex (bundled with torch_npu 2.14 as `torch_npu/dynamo/npugraph_ex`) captures each graph
into an ACL graph itself and refreshes, at every replay, the host lengths of the torch_npu ops it
knows: argument 7 (`context_lens`) of `torch.ops.atb._npu_paged_attention.default` when that
argument is a graph input, and the list arguments `actual_seq_lengths(_kv)` of
`npu_fused_infer_attention_score.out` when their elements are SymInt graph inputs
(`_acl_concrete_graph/acl_graph.py`: `_REPLACE_FUNC_MAP`, `get_update_ruler`). It runs a user pass
on the post-grad graph as `config.post_grad_custom_pre_pass(gm, example_inputs, config)`.

`npugraph_ex_pre_pass(config)` is such a pass. On a graph calling `ascend.attention` it runs kernel
selection and workspace insertion for the graph's bucket, then lowers each kernel to the torch_npu
op npugraph_ex refreshes, so a torchair user gets the rewrite (the kernel the policy picks, one
worst-case workspace for all layers, probed through torch_npu's own queries) without our capture
loop. The graph keeps its signature: the host-list inputs `select_kernels` adds are dropped again.

What npugraph_ex can refresh bounds what this supports: PA, with `seq_lens` a graph input held on
the host as int32 (ATB reads `context_lens` on the host; vLLM-Ascend keeps it there). FIA's lengths
would have to be SymInt graph inputs, but `ascend.attention` takes them as tensors, so a bucket
whose policy picks FIA (and every mixed-step graph) is refused with an error rather than captured
with lengths frozen at capture time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..config import CompileConfig
from ..ops.npu import kernels as npu_ops
from ..ops import tiling
from ..ops.kernel_policy import KernelChoice, KernelPolicy
from ..ops.npu.workspace_queries import NpuWorkspaceQuery
from .find_attention import AttentionArgs, adapt_attention, attention_args, layer_name
from .fx_utils import example_value, is_op
from .kernel_call import KernelCall, host_placeholders, kernel_calls
from .npu_checks import check_npu_graph
from .probe import ProbedWorkspaceNeed
from .select_kernels import attention_layers, choose_kernels, select_kernels
from .workspaces import GraphKey, NeedFn, WorkspacePlan, insert_workspaces, kernel_sites, plan_workspaces

#: npugraph_ex's hook calling convention: (graph module, example inputs, its CompilerConfig).
PrePass = Callable[[fx.GraphModule, Sequence[Any], Any], None]


@dataclasses.dataclass(frozen=True)
class TorchairRewrite:
    """What `rewrite_for_npugraph_ex` did to one graph."""

    key: GraphKey
    choices: tuple[KernelChoice, ...]
    plan: WorkspacePlan


def _policy(config: CompileConfig) -> KernelPolicy:
    if config.kernel_policy == "auto":
        raise ValueError(
            "kernel_policy: 'auto' times kernels through ascend_compile's runtime; inside npugraph_ex use "
            "'pa', 'pa_max_batch' or 'pa_batch_sizes'"
        )
    return KernelPolicy(config.kernel_policy, config.pa_max_batch, config.pa_batch_sizes)


def _probing_need(attention: fx.Node, config: CompileConfig) -> ProbedWorkspaceNeed:
    """Workspaces sized by torch_npu's own workspace queries (the kernels are torch_npu's)."""
    query = example_value(attention_args(attention).query)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), query.device)
    return ProbedWorkspaceNeed(NpuWorkspaceQuery(kernels, query.dtype), config.workspace_probe_lens)


def _graph_key(attention: fx.Node, bucket: int | None, decode: bool | None) -> GraphKey:
    """The bucket (query tokens) and kind of a graph npugraph_ex compiles for one input shape."""
    args = attention_args(attention)
    tokens = example_value(args.query).shape[0]
    seqs = example_value(args.seq_lens).shape[0]
    if bucket is None:
        if not isinstance(tokens, int):
            raise ValueError("bucket: the graph has a dynamic token count; pass the bucket it is compiled for")
        bucket = tokens
    if decode is None:
        decode = isinstance(seqs, int) and seqs == bucket
    return GraphKey(bucket, decode)


def _host_lengths(gm: fx.GraphModule, call: KernelCall) -> fx.Node:
    """The graph input PA's `context_lens` comes from, checked to be what npugraph_ex refreshes."""
    (host,) = call.meta.host_args
    source = host.source.source
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == source)
    value = example_value(placeholder)
    if value.dtype != torch.int32 or value.device.type != "cpu":
        raise ValueError(
            f"seq_lens: inside npugraph_ex PA reads context_lens from the graph input {source!r} on the host, "
            f"so it must be a CPU torch.int32 tensor (as vLLM-Ascend keeps it), got {value.dtype} on {value.device}"
        )
    return placeholder


def _refuse_fia(calls: list[KernelCall], choices: tuple[KernelChoice, ...]) -> None:
    """FIA's lengths would stay frozen inside npugraph_ex (see the module docstring)."""
    fia = next(((call, choice) for call, choice in zip(calls, choices) if call.meta.kernel == tiling.FIA), None)
    if fia is not None:
        raise ValueError(
            f"{fia[0].node.name}: kernel_policy chose FIA for this graph ({fia[1].reason}); "
            f"npugraph_ex refreshes FIA's lengths only from SymInt graph inputs, and ascend.attention passes "
            f"them as tensors, so they would stay frozen at capture. Under npugraph_ex choose PA for decode "
            f"buckets (kernel_policy 'pa' or a pa_max_batch covering them) and run mixed steps through "
            f"backend 'ascend_graph'"
        )


def _refuse_mla(attention: list[fx.Node]) -> None:
    """Latent attention's kernel takes host lengths, as FIA's does, which npugraph_ex would freeze (see
    `_refuse_fia`); backend 'ascend_graph' refreshes them by task updates (`ops/npu/mla.py`)."""
    for node in attention:
        if is_op(node, torch.ops.ascend.mla_attention):
            raise ValueError(f"{layer_name(node)}: npugraph_ex does not serve latent attention (ascend.mla_attention): "
                             f"its kernel, npu_fused_infer_attention_score_v2, takes actual_seq_qlen/actual_seq_kvlen "
                             f"as host lists, which npugraph_ex refreshes only from SymInt graph inputs, so they would "
                             f"stay frozen at capture; compile the model with backend 'ascend_graph'")


def _lower_to_torch_npu(gm: fx.GraphModule) -> None:
    """Replace each PA node by `torch.ops.atb._npu_paged_attention.default` reading its lengths
    from the graph input npugraph_ex refreshes; drop the host-list inputs select_kernels added."""
    npu_ops.load_torch_npu()
    pa_op = torch.ops.atb._npu_paged_attention.default
    graph = gm.graph
    for call in kernel_calls(gm):
        node, args, shape = call.node, call.args(), call.meta.shape
        lengths = _host_lengths(gm, call)
        with graph.inserting_before(node):
            lowered = graph.call_function(
                pa_op,
                (args["query"], args["key_cache"], args["value_cache"], shape.num_kv_heads, shape.num_heads,
                 args["scale"], args["block_table"], lengths, args["out"]),
                {"workspace": args["workspace"]},
            )
        lowered.meta.update(node.meta)
        node.replace_all_uses_with(lowered)
        graph.erase_node(node)
    for node, _ in host_placeholders(gm):
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def rewrite_for_npugraph_ex(
    gm: fx.GraphModule,
    config: CompileConfig,
    bucket: int | None = None,
    decode: bool | None = None,
    need_fn: NeedFn | None = None,
) -> TorchairRewrite | None:
    """Apply kernel selection and workspace insertion to `gm` in place for one bucket, lowered to
    the torch_npu kernels npugraph_ex captures and refreshes. None when `gm` has no attention.

    `bucket`/`decode`: the query-token count the graph is compiled for and whether its steps are
    decode-only (default: from the graph's static shapes, decode when tokens == sequences).
    `need_fn`: how workspaces are sized (default: torch_npu's workspace queries, probed over
    `config.workspace_probe_lens`).
    """
    attention = adapt_attention(gm)
    if not attention:
        return None
    if config.max_model_len is None:
        raise ValueError("max_model_len: required (workspaces are sized for every length up to it)")
    _refuse_mla(attention)
    key = _graph_key(attention[0], bucket, decode)
    need_fn = need_fn or _probing_need(attention[0], config)
    choices = choose_kernels(attention_layers(gm), key.bucket, _policy(config), key.decode)
    calls = select_kernels(gm, [c.kernel for c in choices])
    _refuse_fia(calls, choices)
    check_npu_graph(gm, [key], frozenset({tiling.PA}))  # PA decode graphs only (FIA and MLA are refused above)
    plan = plan_workspaces([(key, kernel_sites(gm))], config.max_model_len, config.workspace_seq_len, True, need_fn)
    insert_workspaces(gm, [key], plan)
    _lower_to_torch_npu(gm)
    return TorchairRewrite(key, tuple(choices), plan)


def npugraph_ex_pre_pass(
    config: CompileConfig, bucket: int | None = None, decode: bool | None = None
) -> PrePass:
    """A `post_grad_custom_pre_pass` for npugraph_ex applying `rewrite_for_npugraph_ex` to each
    graph it compiles:

        options = {"post_grad_custom_pre_pass": npugraph_ex_pre_pass(CompileConfig(max_model_len=...))}
        torch.compile(model, backend="npugraph_ex", options=options)
    """

    def pre_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any) -> None:
        rewrite_for_npugraph_ex(gm, config, bucket, decode)

    return pre_pass
