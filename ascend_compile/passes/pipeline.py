"""The pass pipeline: one dynamo graph in, one rewritten graph per bucket and a workspace plan out.

For each bucket there is a decode graph (the policy's kernel) and, where that kernel is PA, a
separate mixed graph (FIA) for steps with several query tokens per sequence. The workspace plan
covers all of them, so it is computed after every graph's kernels are chosen.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import fx

from ..config import CompileConfig
from ..ops.tiling import PA
from . import dump
from .find_attention import find_attention
from .hoist_metadata import Prologue, hoist_metadata
from .mutations import MutationFacts, analyse_mutations
from .fx_utils import clone_graph_module, example_value
from .roles import GraphSignature, assign_roles
from .select_kernels import KernelPolicy, select_kernels
from .write_back import WriteBack, build_write_back
from .workspaces import GraphKey, NeedFn, WorkspacePlan, insert_workspaces, kernel_sites, node_need, plan_workspaces

log = logging.getLogger("ascend_compile")


@dataclasses.dataclass
class RewrittenGraphs:
    """Everything lowering needs from the passes."""

    original: fx.GraphModule
    signature: GraphSignature
    graphs: dict[GraphKey, fx.GraphModule]
    plan: WorkspacePlan
    buckets: tuple[int, ...]
    block_size: int
    max_blocks: int
    graph_dir: str | None
    mutations: MutationFacts
    write_back: WriteBack
    prologue: Prologue  # the hoisted metadata inputs, computed from the step's inputs

    def key_for(self, bucket: int, decode: bool) -> GraphKey:
        """The graph serving a step: a bucket's FIA decode graph also serves its mixed steps."""
        key = GraphKey(bucket, decode)
        return key if key in self.graphs else GraphKey(bucket, True)

    def describe(self) -> dict[str, Any]:
        """The plan.json content the passes know (lowering adds update tables)."""
        graphs = {}
        for key, gm in self.graphs.items():
            kernels = [
                {"node": n.name, "attention": n.meta["ascend_attention"], **n.meta["ascend_kernel"]}
                for n in gm.graph.nodes
                if "ascend_kernel" in n.meta
            ]
            graphs[str(key)] = {
                "bucket": key.bucket,
                "decode": key.decode,
                "kernels": kernels,
                "workspace_slot": self.plan.graph_slot[str(key)],
            }
        return {
            "buckets": list(self.buckets),
            "static_shapes": self.signature.is_static,
            "tokens": str(self.signature.tokens),
            "padding": self.signature.pad_reason or "padded to the bucket",
            "symbols": {str(sym): kind.value for sym, kind in self.signature.symbol_kinds.items()},
            "input_writes": [{"input": self.signature.inputs[w.input].name, "node": w.node,
                              "padding_safe": w.padding_safe} for w in self.mutations.writes],
            "write_back": self.write_back.describe(),
            "hoisted_metadata": list(self.prologue.names),
            "block_size": self.block_size,
            "max_blocks": self.max_blocks,
            "inputs": [
                {"index": s.index, "name": s.name, "role": s.role.value, "mutated": s.mutated,
                 "shape": None if s.shape is None else [str(d) for d in s.shape]}
                for s in self.signature.inputs
            ],
            "graphs": graphs,
            "workspace": self.plan.to_json(),
        }


def _buckets(signature: GraphSignature, config: CompileConfig) -> tuple[int, ...]:
    """The capture sizes, or the one token count of a graph dynamo traced with a static one."""
    if isinstance(signature.tokens, int):
        return (signature.tokens,)
    return config.capture_sizes


def rewrite_buckets(
    gm: fx.GraphModule, config: CompileConfig, policy: KernelPolicy, need_fn: NeedFn = node_need
) -> RewrittenGraphs | None:
    """Run every pass over `gm` for every bucket; None when the graph has no attention.

    `need_fn` sizes workspaces (see `plan_workspaces`)."""
    attention = find_attention(gm)
    if not attention:
        return None
    if config.max_model_len is None:
        raise ValueError(
            "max_model_len: required for graphs with paged attention (workspaces are sized for every "
            "length up to it); pass options={'max_model_len': N}"
        )
    original, gm = gm, clone_graph_module(gm)
    prologue = hoist_metadata(gm)
    attention = find_attention(gm)
    mutations = analyse_mutations(gm)
    signature = assign_roles(gm, attention, mutations)
    write_back = build_write_back(gm, signature, mutations)
    if signature.pad_reason:
        log.info("ascend_compile: steps are not padded (each size is captured as is): %s", signature.pad_reason)
    block_size = int(example_value(attention[0].args[1]).shape[1])
    max_blocks = -(-config.max_model_len // block_size)
    graph_dir = dump.new_graph_dir(config.dump_dir) if config.dump_dir else None
    dump.dump_graph(original, graph_dir, "original", "dynamo")
    if prologue.graph is not None:
        dump.dump_graph(prologue.graph, graph_dir, "original", "prologue")

    buckets = _buckets(signature, config)
    graphs: dict[GraphKey, fx.GraphModule] = {}
    for bucket in buckets:
        decode_graph = clone_graph_module(gm)
        choices = select_kernels(decode_graph, bucket, policy, decode=True)
        graphs[GraphKey(bucket, True)] = decode_graph
        log.debug("ascend_compile: bucket %d decode steps: %s", bucket, choices[0].reason)
        if any(c.kernel == PA for c in choices):
            mixed_graph = clone_graph_module(gm)
            select_kernels(mixed_graph, bucket, policy, decode=False)
            graphs[GraphKey(bucket, False)] = mixed_graph
    plan = plan_workspaces(((k, kernel_sites(g)) for k, g in graphs.items()), config.max_model_len,
                           config.workspace_seq_len, config.share_workspace, need_fn)
    for warning in plan.warnings():
        log.warning(warning)
    for key, graph in graphs.items():
        dump.dump_graph(graph, graph_dir, str(key), "1_select_kernels")
        insert_workspaces(graph, key, plan)
        dump.dump_graph(graph, graph_dir, str(key), "2_insert_workspaces")
    result = RewrittenGraphs(original, signature, graphs, plan, buckets, block_size, max_blocks, graph_dir, mutations,
                             write_back, prologue)
    log.info(
        "ascend_compile: %d attention nodes, %d graphs over buckets %s, workspace %s",
        len(attention), len(graphs), list(buckets), {n: s.nbytes for n, s in plan.slots.items()},
    )
    return result
