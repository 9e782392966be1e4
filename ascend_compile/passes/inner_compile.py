"""Compile a bucket graph with an inner compiler (inductor), attention staying our opaque op.

The bucket graph keeps its nodes (so dumps and plans still show every kernel); what is compiled is
a copy whose workspace nodes became inputs, so the compiled code takes the compiled artifact's
workspace slots instead of allocating its own. The attention and cache ops are custom ops, so
inductor keeps each as one call and fuses the ops around them (norms, rotary embeddings, SwiGLU).
Compilation happens on the first call, which lowering makes before capturing (`DeviceGraph.warmup`),
with the bucket's static shapes. The result is kept in `gm.meta[INNER_KEY]`, where
`lowering/capture.py` finds it; only runtimes whose kernels need no task updates (CUDA) run it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .fx_utils import is_op

#: The key of `fx.GraphModule.meta` holding a bucket graph's `InnerCompiled`.
INNER_KEY = "ascend_inner"


@dataclasses.dataclass(frozen=True)
class InnerCompiled:
    """A bucket graph compiled by `compiler`: called with the graph's arguments, it returns its outputs."""

    compiler: str
    compiled: Callable[..., Any]  # takes the graph's arguments, then one tensor per workspace node
    workspaces: tuple[fx.Node, ...]  # the bucket graph's workspace nodes, in that order

    def __call__(self, args: Sequence[Any], workspace_for: Callable[[fx.Node], torch.Tensor]) -> Any:
        """Run the compiled graph; `workspace_for` gives the tensor of each workspace node."""
        return self.compiled(*args, *(workspace_for(n) for n in self.workspaces))


def compile_inner(gm: fx.GraphModule, compiler: str) -> InnerCompiled:
    """Attach to `gm` (in `gm.meta[INNER_KEY]`) its compiled form, built on first call by
    `torch.compile(backend=compiler)` with static shapes and no graph breaks."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    workspaces = [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.workspace)]
    for node in inputs + workspaces:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    output = None
    for node in gm.graph.nodes:
        if node.op == "output":
            output = node
        elif node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(fx.node.map_arg(output.args[0], env.__getitem__))
    module = fx.GraphModule(gm, graph)
    compiled = torch.compile(module, backend=compiler, dynamic=False, fullgraph=True)
    inner = InnerCompiled(compiler, compiled, tuple(workspaces))
    gm.meta[INNER_KEY] = inner
    return inner
