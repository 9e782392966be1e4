"""`ForwardContextBinder`: vLLM's and vLLM-Ascend's real attention ops onto the `ascend` ops, their
metadata and caches read from the forward context.

vLLM's model graphs call `vllm::unified_attention_with_output(query, key, value, output, layer_name,
...)` and, where the attention backend does not write the cache itself (FLASH_ATTN),
`vllm::unified_kv_cache_update(key, value, layer_name)`. Both take only a layer name: the metadata,
the layer and its KV cache come from `get_forward_context()` (`attn_metadata[layer_name]`,
`no_compile_layers[layer_name].kv_cache`, `slot_mapping[layer_name]`). `ForwardContextBinder` is the
binder (`passes/providers.py`) that rewrites both ops onto `ascend.reshape_and_cache` /
`ascend.attention` (with the layer's sliding window, soft-cap and sinks, `layers.layer_features`)
and makes every value they read a provided input, read from the forward context once per step: the
runner stages it by role like any input, and the update table refreshes PA/FIA host lengths from it
— what vLLM-Ascend's `update_graph_params` does by hand. MLA layers' ops (`unified_mla_*`) are
rewritten onto `ascend.mla_attention` / `ascend.mla_cache_write` by `mla.py`; a metadata group's
inputs are bound by `metadata.py`, the caches read through `context.py`.

This module also finds the graph's vLLM attention and cache-update nodes (`vllm_graph_nodes`), which
the backend (`dynamo_backend.py`) asks before choosing a binder at all.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ...passes.fx_utils import example_value, fill_fake_values, is_op, node_arg, placeholders
from ...passes.providers import Provider, ProvidedInput, add_provided_input, fake_like, fake_mode_of
from .context import CacheViews, begin_pass, end_pass, has_cache, kv_transfer_configured, split_cache, step_semantics
from .layers import (UnsupportedAttention, layer_features, refuse_cache_dtype, refuse_metadata,
                     refuse_unsupported)
from .metadata import bind_metadata
from .mla import MLA_CACHE_UPDATE_OP, MlaRewrite, has_latent_cache, mla_graph_nodes, refuse_unsupported as refuse_unsupported_mla

ATTENTION_OP = "unified_attention_with_output"
CACHE_UPDATE_OP = "unified_kv_cache_update"


def _vllm_op(name: str) -> Any:
    """`torch.ops.vllm.<name>`, or None where vLLM (or a stand-in) has not registered it."""
    try:
        return getattr(torch.ops.vllm, name)
    except (AttributeError, RuntimeError):
        return None


def _default_forward_context() -> Any:
    from vllm.forward_context import get_forward_context

    return get_forward_context()


def vllm_graph_nodes(gm: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """The graph's vLLM attention and cache-update nodes."""
    attention, update = _vllm_op(ATTENTION_OP), _vllm_op(CACHE_UPDATE_OP)
    return ([n for n in gm.graph.nodes if attention is not None and is_op(n, attention)],
            [n for n in gm.graph.nodes if update is not None and is_op(n, update)])


@dataclasses.dataclass
class _Reader:
    """One provided input: where it goes in the graph and how to read it from a forward context."""

    provided: ProvidedInput
    read: Callable[[Any], torch.Tensor]


class ForwardContextBinder:
    """A binder for vLLM graphs: see the module docstring. `get_forward_context` is vLLM's by default."""

    def __init__(self, get_forward_context: Callable[[], Any] | None = None,
                 example_inputs: Sequence[Any] = ()) -> None:
        self.get_forward_context = get_forward_context or _default_forward_context
        self.example_inputs = list(example_inputs)
        self.group_layers: list[str] = []  # one layer per metadata group bound, set by the rewrite

    # -------------------------------------------------------------- what the forward context holds

    def current_context(self) -> Any:
        """The forward context, or None outside one (vLLM asserts there is one)."""
        try:
            return self.get_forward_context()
        except AssertionError:
            return None

    def not_ready(self, layers: Sequence[str]) -> str | None:
        """Why the current step cannot be compiled against (None: it can): no forward context, no
        metadata (vLLM's profiling run, before the KV caches exist), list-form metadata (DBO /
        micro-batching), or one of the graph's `layers` without a KV cache bound."""
        ctx = self.current_context()
        if ctx is None:
            return "no forward context"
        metadata = ctx.attn_metadata
        if metadata is None:
            return "no attention metadata (vLLM's profiling run)"
        if isinstance(metadata, list):
            return "attn_metadata is a list (DBO / micro-batching), which ascend_graph does not support"
        for name in layers:
            layer = ctx.no_compile_layers.get(name)
            if layer is None or not (has_cache(getattr(layer, "kv_cache", None))
                                     or has_latent_cache(getattr(layer, "kv_cache", None))):
                return f"layer {name!r} has no KV cache bound (forward_context.no_compile_layers[{name!r}].kv_cache)"
        return None

    def longest_sequence(self) -> int | None:
        """The longest KV length of the current step, from the host copies the metadata keeps
        (FLASH_ATTN's `max_seq_len`, vLLM-Ascend's `seq_lens_list`), over every metadata group the
        compile bound; None where no host copy exists (the runner then checks the device lengths)."""
        ctx = self.get_forward_context()
        longest = None
        for layer in self.group_layers:
            metadata = ctx.attn_metadata[layer]
            value = getattr(metadata, "max_seq_len", None)
            if value is None and getattr(metadata, "seq_lens_list", None):
                value = max(metadata.seq_lens_list)
            if value is not None:
                longest = max(longest or 0, int(value))
        return longest

    def unserved_step(self) -> str | None:
        """Why the current step's metadata asks for attention the compiled graph does not compute
        (`context.step_semantics`, over every metadata group the compile bound); None: it does not."""
        ctx = self.get_forward_context()
        for layer in self.group_layers:
            reason = step_semantics(ctx.attn_metadata[layer])
            if reason is not None:
                return f"layer {layer!r}'s metadata asks for {reason}"
        return None

    def layer_name(self, gm: fx.GraphModule, node: fx.Node) -> str:
        """The layer name of a vLLM op node: a constant `str`, or vLLM's `LayerName` hoisted to a graph
        input (torch >= 2.11), whose example input holds it."""
        update = any(is_op(node, _vllm_op(op)) for op in (CACHE_UPDATE_OP, MLA_CACHE_UPDATE_OP))
        arg = node_arg(node, 2 if update else 4, "layer_name")
        if isinstance(arg, fx.Node):
            index = placeholders(gm).index(arg)
            value = self.example_inputs[index] if index < len(self.example_inputs) else example_value(arg)
            arg = getattr(value, "value", value)
        if not isinstance(arg, str):
            raise TypeError(f"{node.name}.layer_name: expected a str or vLLM LayerName, got {type(arg).__name__}")
        return arg

    def layer_names(self, gm: fx.GraphModule) -> list[str]:
        """The layer names of the graph's vLLM attention nodes (MLA's after the others), in graph order."""
        return [self.layer_name(gm, node) for node in vllm_graph_nodes(gm)[0] + mla_graph_nodes(gm)[0]]

    def refuse_unsupported(self, gm: fx.GraphModule, ctx: Any) -> None:
        """Refuse, naming the layer and the feature, any of the graph's attention layers the rewrite
        would compute wrongly (`layers.refusal`), and a configured KV-transfer connector."""
        names = self.layer_names(gm)
        mla = {self.layer_name(gm, node) for node in mla_graph_nodes(gm)[0]}
        refuse_unsupported({name: ctx.no_compile_layers[name] for name in names if name not in mla})
        refuse_unsupported_mla({name: ctx.no_compile_layers[name] for name in names if name in mla})
        if kv_transfer_configured():
            raise UnsupportedAttention(
                names[0], "a KV-transfer connector (kv_transfer_config: its per-layer "
                "wait_for_layer_load / save_kv_layer hooks run in Python around vLLM's attention op, which a "
                "captured graph replaces)")

    # -------------------------------------------------------------- the rewrite

    def __call__(self, gm: fx.GraphModule) -> Provider | None:
        attention, updates = vllm_graph_nodes(gm)
        mla_attention, mla_updates = mla_graph_nodes(gm)
        if not attention and not mla_attention:
            return None
        ctx = self.get_forward_context()
        self.refuse_unsupported(gm, ctx)
        self.group_layers = []
        if ctx.attn_metadata is None or isinstance(ctx.attn_metadata, list):
            raise ValueError("forward_context.attn_metadata: expected a dict of per-layer metadata at compile time "
                             "(a step with metadata), got "
                             + ("None" if ctx.attn_metadata is None else "a list (DBO / ubatching: not supported)"))
        fake_mode = fake_mode_of(gm)
        readers: list[_Reader] = []
        groups: dict[int, dict[str, fx.Node]] = {}
        caches: dict[str, tuple[fx.Node, fx.Node]] = {}
        graph = gm.graph

        hosts: list[Callable[[Any], dict[str, list[int]]]] = []

        def provide(name: str, source: str, read: Callable[[Any], torch.Tensor], fake: torch.Tensor,
                    host: Callable[[Any], dict[str, list[int]]] | None = None) -> fx.Node:
            reader = _Reader(ProvidedInput(name, source), read)
            readers.append(reader)
            if host is not None:
                hosts.append(host)
            return add_provided_input(gm, reader.provided, fake)

        def metadata_inputs(layer: str, tokens: Any) -> dict[str, fx.Node]:
            metadata = ctx.attn_metadata[layer]
            refuse_metadata(layer, metadata)
            key = id(metadata)
            if key not in groups:
                self.group_layers.append(layer)
                groups[key] = bind_metadata(len(groups), layer, metadata, tokens, fake_mode, provide)
            return groups[key]

        def cache_inputs(layer: str) -> tuple[fx.Node, fx.Node]:
            if layer not in caches:
                caches[layer] = self._bind_cache(layer, ctx.no_compile_layers[layer], fake_mode, provide)
            return caches[layer]

        def sinks_input(layer: str, attn_layer: Any) -> fx.Node:
            where = f"forward_context.no_compile_layers[{layer!r}].impl.sinks"
            return provide(f"vllm_sinks_{layer.replace('.', '_')}", where,
                           lambda c: c.no_compile_layers[layer].impl.sinks, fake_like(fake_mode, attn_layer.impl.sinks))

        slots: dict[int, fx.Node] = {}

        def slot_input(layer: str, tokens: Any) -> fx.Node:
            real = ctx.slot_mapping[layer]
            if id(real) not in slots:
                slots[id(real)] = self._bind_slot_mapping(len(slots), layer, real, tokens, fake_mode, provide)
            return slots[id(real)]

        for node in updates:
            layer = self.layer_name(gm, node)
            key, value = node.args[0], node.args[1]
            slot_mapping = slot_input(layer, example_value(key).shape[0])
            key_cache, value_cache = cache_inputs(layer)
            with graph.inserting_before(node):
                graph.call_function(torch.ops.ascend.reshape_and_cache.default,
                                    (key, value, key_cache, value_cache, slot_mapping))
        for node in attention:
            self._rewrite_attention(gm, node, ctx, metadata_inputs, cache_inputs, sinks_input)
        for node in updates:  # its result, vLLM's ordering token (`kv_cache_dummy_dep`), kept where still read
            if node.users:  # past the attention just rewritten (a graph output): `torch.empty(0)` as vLLM's
                with graph.inserting_before(node):
                    token = graph.call_function(torch.ops.aten.new_empty.default, (node.args[0], [0]))
                node.replace_all_uses_with(token)
            graph.erase_node(node)
        self.group_layers += MlaRewrite(gm, ctx, fake_mode, provide, functools.partial(self.layer_name, gm),
                                        slot_input).rewrite(mla_attention, mla_updates)
        for node in reversed(list(graph.nodes)):
            if node.op == "call_function" and node.target is torch.ops.aten.empty.memory_format and not node.users:
                graph.erase_node(node)
        fill_fake_values(graph)
        graph.lint()
        gm.recompile()
        get = self.get_forward_context
        return Provider(tuple(r.provided for r in readers), lambda args: _read_all(get(), readers),
                        (lambda args: _host_all(get(), hosts)) if hosts else None)

    def _rewrite_attention(self, gm: fx.GraphModule, node: fx.Node, ctx: Any, metadata_inputs: Callable,
                           cache_inputs: Callable, sinks_input: Callable) -> None:
        layer_name = self.layer_name(gm, node)
        query, key, value, output = node.args[:4]
        for position, name in ((5, "output_scale"), (6, "output_block_scale")):
            if node_arg(node, position, name) is not None:
                raise ValueError(f"{node.name}.{name}: fused output quantization is not supported by ascend_graph")
        layer = ctx.no_compile_layers[layer_name]
        tokens = example_value(query).shape[0]
        metadata = metadata_inputs(layer_name, tokens)
        key_cache, value_cache = cache_inputs(layer_name)
        features = layer_features(layer_name, layer)
        sinks = sinks_input(layer_name, layer) if features.sinks else None
        graph = gm.graph
        with graph.inserting_before(node):
            if getattr(layer.attn_backend, "forward_includes_kv_cache_update", True) and key is not None:
                graph.call_function(torch.ops.ascend.reshape_and_cache.default,
                                    (key, value, key_cache, value_cache, metadata["slot_mapping"]))
            result = graph.call_function(torch.ops.ascend.attention.default, (
                query, key_cache, value_cache, metadata["block_table"], metadata["seq_lens"],
                metadata["query_start_loc"], float(layer.impl.scale)),
                {"window": features.window, "soft_cap": features.soft_cap, "sinks": sinks})
            graph.call_method("copy_", (output, result))
        result.meta["ascend_adapted_from"] = f"vllm.{ATTENTION_OP} ({node.name}, layer {layer_name!r})"
        graph.erase_node(node)

    @staticmethod
    def _bind_slot_mapping(index: int, layer: str, real: torch.Tensor, tokens: Any, fake_mode: Any,
                           provide: Callable) -> fx.Node:
        """FLASH_ATTN's cache-write slots, `forward_context.slot_mapping[layer]` (one input for every
        layer sharing the tensor)."""
        return provide(f"vllm_slot_mapping_{index}", f"forward_context.slot_mapping[{layer!r}]",
                       lambda c: c.slot_mapping[layer], fake_like(fake_mode, real, (tokens,)))

    @staticmethod
    def _bind_cache(layer: str, attn_layer: Any, fake_mode: Any, provide: Callable
                    ) -> tuple[fx.Node, fx.Node]:
        """A layer's key and value caches, `[num_blocks, block_size, kv_heads, head_dim]` each: vLLM 0.23's
        `[num_blocks, 2, ...]` cache unbound on dim 1, vLLM 0.33's page split (`context.split_cache`),
        or vLLM-Ascend's `(key, value)` pair."""
        where = f"forward_context.no_compile_layers[{layer!r}].kv_cache"
        key, value = split_cache(attn_layer.kv_cache, where, getattr(attn_layer, "head_size", None))
        refuse_cache_dtype(layer, key)
        name = layer.replace(".", "_")
        views = CacheViews(layer, where)  # split once per cache tensor, not every step
        return (provide(f"vllm_key_cache_{name}", f"{where} (key)", lambda ctx: views(ctx)[0],
                        fake_like(fake_mode, key)),
                provide(f"vllm_value_cache_{name}", f"{where} (value)", lambda ctx: views(ctx)[1],
                        fake_like(fake_mode, value)))


def _read_all(ctx: Any, readers: Sequence[_Reader]) -> list[torch.Tensor]:
    token = begin_pass()  # a layer's key and value readers check its cache once (`CacheViews`)
    try:
        return [r.read(ctx) for r in readers]
    finally:
        end_pass(token)


def _host_all(ctx: Any, hosts: Sequence[Callable[[Any], dict[str, list[int]]]]) -> dict[str, list[int]]:
    copies: dict[str, list[int]] = {}
    for host in hosts:
        copies.update(host(ctx))
    return copies
