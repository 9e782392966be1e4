"""Rewrite a bucket graph's PA/FIA nodes into the device-length ops, for runtimes without task updates.

`select_kernels` gives each kernel host-side lengths (lists the runner converts once per step and
a device graph freezes at capture; Ascend refreshes them with task updates). A CUDA graph has no
task updates, so there each kernel reads the lengths from the graph's own `seq_lens` /
`query_start_loc` inputs instead, which the runner copies and pads into static buffers every step:
the "update" is one copy per input per step, shared by every layer. The split count of each kernel
is fixed per bucket on the host (`num_splits_for`), which fixes its workspace
(`ops.cuda.dev_workspace_nbytes`, see `fixed_split_need`).
"""
from __future__ import annotations

import torch
from torch import fx

from ..ops import cuda as cuda_ops
from . import dump
from .fx_utils import is_op
from .workspaces import KERNEL_OPS, GraphKey, KernelSite, NeedFn, NodeNeed

#: The device-length op of each host-length kernel.
DEVICE_LENGTH_OPS = {
    torch.ops.ascend.paged_attention: torch.ops.ascend.paged_attention_dev.default,
    torch.ops.ascend.fused_infer_attention: torch.ops.ascend.fused_infer_attention_dev.default,
}


def use_device_lengths(gm: fx.GraphModule, num_splits_for: cuda_ops.SplitsFn) -> list[fx.Node]:
    """Replace every PA/FIA node of a bucket graph (after `select_kernels` and `insert_workspaces`)
    by its device-length op; returns the new nodes.

    Each new node takes the tensors its host lists were converted from (found through the host
    placeholders' `ascend_host_of`) and `num_splits_for(kernel, shape, bucket)` splits, recorded in
    `meta["ascend_kernel"]["num_splits"]` so the dump shows it. Host placeholders left without users
    are removed; the runner derives the host lists it passes from the placeholders that remain.
    """
    graph = gm.graph
    inputs = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    sources = {n.name: inputs[n.meta["ascend_host_of"]["input"]] for n in inputs.values() if "ascend_host_of" in n.meta}
    rewritten = []
    for node in [n for n in graph.nodes if any(is_op(n, op) for op in KERNEL_OPS)]:
        packet = node.target.overloadpacket
        kernel_meta = node.meta["ascend_kernel"]
        shape = node.meta["ascend_shape"]
        splits = num_splits_for(kernel_meta["kernel"], shape, kernel_meta["bucket"])
        query, key_cache, value_cache, block_table = node.args[:4]
        if packet is torch.ops.ascend.paged_attention:
            context_lens, scale, workspace, out = node.args[4:]
            lengths = (_source(sources, context_lens, node, "context_lens"),)
        else:
            ends, kv_lens, scale, workspace, out = node.args[4:]
            lengths = (_source(sources, ends, node, "actual_seq_lengths"),
                       _source(sources, kv_lens, node, "actual_seq_lengths_kv"))
        with graph.inserting_before(node):
            new = graph.call_function(
                DEVICE_LENGTH_OPS[packet],
                (query, key_cache, value_cache, block_table, *lengths, scale, workspace, out, splits),
            )
        new.meta.update(
            ascend_kernel=dict(kernel_meta, num_splits=splits, lengths="device"),
            ascend_shape=shape,
            ascend_attention=node.meta["ascend_attention"],
            ascend_device_lengths=[n.name for n in lengths],
        )
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten.append(new)
    for name, node in list(inputs.items()):
        if name in sources and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return rewritten


def _source(sources: dict[str, fx.Node], arg: object, node: fx.Node, what: str) -> fx.Node:
    """The graph input a host-list argument was converted from."""
    if not isinstance(arg, fx.Node) or arg.name not in sources:
        raise ValueError(
            f"{node.name}.{what}: expected a host-list placeholder made by select_kernels, got {arg!r}"
        )
    return sources[arg.name]


def fixed_split_need(num_splits_for: cuda_ops.SplitsFn) -> NeedFn:
    """A workspace `NeedFn` for graphs rewritten by `use_device_lengths` with `num_splits_for`.

    With a fixed split count the need is the same for every length, so the exact worst case is the
    need at any length (reported at `max_model_len`); a pinned `workspace_seq_len` changes nothing.
    """

    def need(site: KernelSite, tokens: int, max_model_len: int, pinned_seq_len: int | None) -> NodeNeed:
        splits = num_splits_for(site.kernel, site.shape, tokens)
        nbytes = cuda_ops.dev_workspace_nbytes(tokens, site.shape, splits)
        return NodeNeed(site.node, site.kernel, nbytes, max_model_len, nbytes, max_model_len)

    return need


def apply_device_lengths(graphs: dict[GraphKey, fx.GraphModule], num_splits_for: cuda_ops.SplitsFn, graph_dir: str | None) -> None:
    """`use_device_lengths` on every bucket graph of a compiled graph, dumping the result as stage
    `3_device_lengths` (with `graph_dir`)."""
    for key, gm in graphs.items():
        use_device_lengths(gm, num_splits_for)
        dump.dump_graph(gm, graph_dir, str(key), "3_device_lengths")

