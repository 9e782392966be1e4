"""Compile a bucket graph with an inner compiler (inductor), attention staying our opaque op.

The bucket graph keeps its nodes (so dumps and plans still show every kernel); what is compiled is
a copy whose workspace nodes became inputs, so the compiled code takes the compiled artifact's
workspace slots instead of allocating its own. The attention and cache ops are custom ops, so
inductor keeps each as one call and fuses the ops around them (norms, rotary embeddings, SwiGLU).
Compilation happens on the first call, which lowering makes before capturing (`DeviceGraph.warmup`),
with the bucket's static shapes and buffers. The result is kept in `gm.meta[INNER_KEY]`, where
`lowering/capture.py` finds it; only runtimes whose kernels need no task updates (CUDA) run it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx

from .fx_utils import is_op

#: The key of `fx.GraphModule.meta` holding a bucket graph's `InnerCompiled`.
INNER_KEY = "ascend_inner"


class InnerCompiled:
    """A bucket graph compiled by `compiler`: called with the graph's arguments, it returns its outputs.

    The compiler runs on the first call, on that call's arguments (static shapes), through
    `torch._inductor.compile` rather than `torch.compile`: the runner is called from inside the
    model's compiled frame, where dynamo does not compile again.
    """

    def __init__(self, compiler: str, module: fx.GraphModule, workspaces: Sequence[fx.Node]) -> None:
        if compiler != "inductor":
            raise ValueError(f"inner_compiler: expected 'inductor', got {compiler!r}")
        self.compiler = compiler
        self.module = module  # the bucket graph, taking one tensor per workspace node after its arguments
        self.workspaces = tuple(workspaces)  # the bucket graph's workspace nodes, in that order
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, args: Sequence[Any], workspace_for: Callable[[fx.Node], torch.Tensor]) -> Any:
        """Run the compiled graph (compiling it first); `workspace_for` gives each workspace node's tensor."""
        inputs = [*args, *(workspace_for(n) for n in self.workspaces)]
        with torch.no_grad():
            if self.compiled is None:
                from torch._inductor import compile as inductor_compile

                self.compiled = inductor_compile(self.module, inputs)
            return self.compiled(*inputs)


def compile_inner(gm: fx.GraphModule, compiler: str) -> InnerCompiled:
    """Attach to `gm` (in `gm.meta[INNER_KEY]`) its form for `compiler`, compiled on first call."""
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
    inner = InnerCompiled(compiler, fx.GraphModule(gm, graph), workspaces)
    gm.meta[INNER_KEY] = inner
    return inner
