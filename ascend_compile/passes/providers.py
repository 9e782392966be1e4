"""Inputs a runtime provides each step instead of passing them to the graph.

vLLM's attention ops take only a layer name: the block table, `seq_lens`, `query_start_loc`, slot
mapping and KV cache come from its global forward context, so the graph it compiles carries none
of them. A *binder* (an integration's pass, see `integrations/vllm/binder.py`) rewrites such ops onto
`ascend.attention` / `ascend.reshape_and_cache` and turns each value they read into a graph input
of its own, with a `ProvidedInput` saying where it comes from; the returned `Provider` reads them
once per step. From then on they are inputs like any other: the runner stages them by role (static
buffers, padding), the update table refreshes host lengths from them, and dumps name their source.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from .fx_utils import example_value, placeholders

@dataclasses.dataclass(frozen=True)
class ProvidedInput:
    """One graph input a provider supplies: the placeholder's name and the provider field it reads."""

    name: str
    source: str  # e.g. "forward_context.attn_metadata['layers.0.attn'].seq_lens"


@dataclasses.dataclass
class Provider:
    """Reads the provided inputs of one step (in `inputs` order), from the step's own arguments and
    whatever the runtime keeps outside the graph; called once per step, before anything else.

    `host`, where the runtime keeps host copies of length inputs (vLLM-Ascend's `seq_lens_list` and
    `actual_seq_lengths_q` beside its device tensors), gives them for the step, by input name, as
    the runner's `tolist()` of that input would (`query_start_loc` with its leading 0): the runner
    takes them instead of reading the input's data, a device-to-host sync. The provider vouches that
    they are the step's lengths; an input it has no trustworthy copy of is left out."""

    inputs: tuple[ProvidedInput, ...]
    read: Callable[[Sequence[Any]], Sequence[Any]]
    host: Callable[[Sequence[Any]], Mapping[str, list[int]]] | None = None

    def describe(self) -> list[dict[str, str]]:
        return [dataclasses.asdict(i) for i in self.inputs]


#: A binder rewrites a (cloned) graph in place so that what its ops read from outside the graph
#: becomes provided inputs; it returns their provider, or None when the graph has nothing to bind.
Binder = Callable[[fx.GraphModule], "Provider | None"]


def fake_mode_of(gm: fx.GraphModule) -> Any:
    """The fake mode of the graph's example values (None for a graph without any)."""
    return torch._guards.detect_fake_mode([example_value(n) for n in placeholders(gm)])


def fresh_size(fake_mode: Any, hint: int, name: str) -> Any:
    """A new symbolic size (a plain int in a graph traced without symbols) for a provided input's
    dimension; its hint is at least 2 so that torch does not specialise it as 0 or 1."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return hint
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(f"ascend_provided_{name}")
    hint = max(int(hint), 2)
    symbol = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(symbol, hint=hint, source=source)


def fake_like(fake_mode: Any, real: torch.Tensor, shape: Sequence[Any] | None = None) -> torch.Tensor:
    """A fake tensor with `real`'s dtype and device and `shape`; by default `real`'s shape (static) and
    strides, so the passes see the layout the step brings (e.g. one half of a `[num_blocks, 2, ...]` KV
    cache is not contiguous)."""
    with fake_mode:
        if shape is None:
            return torch.empty_strided(tuple(real.shape), real.stride(), dtype=real.dtype, device=real.device)
        return torch.empty(tuple(shape), dtype=real.dtype, device=real.device)


def add_provided_input(gm: fx.GraphModule, provided: ProvidedInput, fake: torch.Tensor) -> fx.Node:
    """A new graph input (after the existing ones) standing for `provided`, with example value `fake`."""
    graph = gm.graph
    with graph.inserting_after(placeholders(gm)[-1]):
        node = graph.placeholder(provided.name)
    node.meta["example_value"] = fake
    return node
