"""Rewrite each attention node into a kernel: PA or FIA, or MLA for a latent-attention node,
with host-side lengths.

The kernels take host-side lengths; the rewrite adds one host-list input per source it converts
(one `seq_lens` list shared by every layer), which the runner fills once per step and lowering
freezes into captured tasks. Each kernel node gets an unplanned workspace (0 bytes) that
`insert_workspaces` replaces, and its `KernelMeta` (see `kernel_call.py`).

Which kernel serves a bucket is the policy's (`ops.kernel_policy`); buckets whose choices agree
share one rewritten graph, a *variant* (`choose_kernels` per bucket, `select_kernels` per variant).
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

import torch
from torch import fx

from ..ops import tiling
from ..ops.features import AttentionFeatures
from ..ops.kernel_policy import KernelChoice, KernelPolicy, choose_kernel
from .find_attention import attention_args, attention_nodes, by_name
from .fx_utils import example_value
from .kernel_call import (HOST_LENGTH_ARGS, HOST_LENGTH_OPS, HOST_META_KEY, META_KEY, Conversion, HostArg, HostSource,
                          KernelCall, KernelMeta, arg_names, build_args)


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """What the kernel choice of one attention node depends on: its static shape and features."""

    shape: tiling.AttentionShape
    features: AttentionFeatures


def attention_layers(gm: fx.GraphModule) -> list[AttentionLayer]:
    """The shape and features of each attention node of `gm`, in graph order."""
    layers = []
    for node in attention_nodes(gm):
        args = attention_args(node)
        layers.append(AttentionLayer(args.shape(), args.features))
    return layers


def choose_kernels(layers: Sequence[AttentionLayer], bucket: int, policy: KernelPolicy,
                   decode: bool) -> tuple[KernelChoice, ...]:
    """The policy's kernel for each attention node in a graph of `bucket` tokens: per layer, since
    a layer with a feature PA lacks takes FIA in every bucket."""
    return tuple(choose_kernel(policy, bucket, decode, layer.shape, layer.features) for layer in layers)


def _host_input(graph: fx.Graph, source: fx.Node, conversion: Conversion) -> fx.Node:
    """The placeholder carrying the host-side list of `source` (created once per source and conversion)."""
    host = HostSource(source.name, conversion)
    name = host.placeholder_name()
    for node in graph.find_nodes(op="placeholder"):
        if node.name == name:
            return node
    last = graph.find_nodes(op="placeholder")[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    node.meta[HOST_META_KEY] = host
    return node


def select_kernels(gm: fx.GraphModule, kernels: Sequence[str], eager: Collection[str] = ()) -> list[KernelCall]:
    """Rewrite the attention nodes of `gm` into `kernels` (one per node, in graph order), but those named in
    `eager` (layers the device refused, served eagerly: left as attention ops, which no full graph captures
    and piecewise graphs run between pieces); the caller recompiles `gm` once its passes are done."""
    graph = gm.graph
    nodes = attention_nodes(gm)
    if len(nodes) != len(kernels):
        raise ValueError(f"kernels: expected one per attention node ({len(nodes)}), got {len(kernels)}")
    calls = []
    for node, kernel in zip(nodes, kernels):
        if node.name in eager:
            continue
        args = attention_args(node)
        shape = args.shape()
        features = args.features
        if kernel == tiling.PA and not features.plain:
            raise ValueError(f"{node.name}: PA does not take {', '.join(features.names())}; the layer needs FIA")
        if (kernel == tiling.MLA) != shape.latent:
            raise ValueError(f"{node.name}: the MLA kernel serves latent-attention nodes (ascend.mla_attention) "
                             f"and only them; got kernel {kernel!r} for {node.target}")
        op = HOST_LENGTH_OPS[kernel]
        named = {name: value for name, value in by_name(args).items() if name in arg_names(op)}
        with graph.inserting_before(node):
            out = graph.call_function(torch.empty_like, (args.query,))
            out.meta["example_value"] = example_value(node)
            workspace = graph.call_function(torch.ops.ascend.workspace.default, (0, example_value(args.query).device))
            hosts = {name: _host_input(graph, getattr(args, src), conv)
                     for name, (src, conv) in HOST_LENGTH_ARGS[kernel].items()}
            call = graph.call_function(op, build_args(op, {**named, **hosts, "workspace": workspace, "out": out}))
        host_args = tuple(HostArg(name, host.meta[HOST_META_KEY]) for name, host in hosts.items())
        call.meta[META_KEY] = meta = KernelMeta(kernel, node.name, shape, host_args, features=features)
        call.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "ascend_adapted_from")
                          if k in node.meta})  # where the attention was traced, for messages naming the layer
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        calls.append(KernelCall(call, meta))
    graph.lint()
    return calls

