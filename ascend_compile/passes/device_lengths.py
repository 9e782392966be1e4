"""Rewrite a bucket graph's PA/FIA nodes into the device-length ops, for runtimes without task updates.

`select_kernels` gives each kernel host-side lengths (lists the runner converts once per step and
a device graph freezes at capture; Ascend refreshes them with task updates). A CUDA graph has no
task updates, so there each kernel reads the lengths from the graph's own `seq_lens` /
`query_start_loc` inputs instead, which the runner copies and pads into static buffers every step:
the "update" is one copy per input per step, shared by every layer. The split count of each kernel
is fixed per bucket on the host (`num_splits_for`), which fixes its workspace
(`ops.cuda.dev_workspace_nbytes`, see `fixed_split_need`); so this pass runs when a bucket is
specialised (at its capture), on a copy of its variant graph.
"""
from __future__ import annotations

import dataclasses

from torch import fx

from ..ops import cuda as cuda_ops
from .kernel_call import (DEVICE_LENGTH_ARGS, DEVICE_LENGTH_OPS, META_KEY, KernelCall, build_args, host_placeholders,
                          kernel_calls)
from .workspaces import KernelSite, NeedFn, NodeNeed


def use_device_lengths(gm: fx.GraphModule, bucket: int, num_splits_for: cuda_ops.SplitsFn) -> list[KernelCall]:
    """Replace every PA/FIA node of a graph (after `select_kernels` and `insert_workspaces`) by its
    device-length op with `num_splits_for(kernel, shape, bucket)` splits; returns the new calls.

    Each new node reads the tensor its host lists were converted from (`HostArg.source`) and takes
    the host node's other arguments as they are: FIA's `window`, `soft_cap` and `sinks` (the layer's
    `KernelMeta.features`, which the new meta keeps) included. Its `KernelMeta` records the split
    count and `lengths="device"`, so the dump shows them. Host
    placeholders left without users are removed; the runner derives the host lists it passes from
    the placeholders that remain.
    """
    graph = gm.graph
    inputs = {n.name: n for n in graph.find_nodes(op="placeholder")}
    rewritten = []
    for call in kernel_calls(gm):
        meta = call.meta
        splits = num_splits_for(meta.kernel, meta.shape, bucket)
        values = {name: value for name, value in call.args().items()
                  if name not in {a.kernel_arg for a in meta.host_args}}
        for host in meta.host_args:
            if host.source.source not in inputs:
                raise ValueError(f"{call.node.name}.{host.kernel_arg}: its source {host.source.source!r} "
                                 f"is not a graph input")
            values[DEVICE_LENGTH_ARGS[host.kernel_arg]] = inputs[host.source.source]
        op = DEVICE_LENGTH_OPS[meta.kernel]
        with graph.inserting_before(call.node):
            new = graph.call_function(op, build_args(op, {**values, "num_splits": splits}))
        new.meta[META_KEY] = new_meta = dataclasses.replace(meta, lengths="device", num_splits=splits, host_args=())
        call.node.replace_all_uses_with(new)
        graph.erase_node(call.node)
        rewritten.append(KernelCall(new, new_meta))
    for node, _ in host_placeholders(gm):
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return rewritten


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
