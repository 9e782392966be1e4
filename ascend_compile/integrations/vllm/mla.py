"""vLLM's MLA ops onto the `ascend` library's latent attention (`ops/mla.py`).

vLLM 0.23.0's and 0.33.0's `MLAAttention` layer (`vllm/model_executor/layers/attention/mla_attention.py`) calls
`vllm::unified_mla_kv_cache_update(kv_c_normed, k_pe, layer_name, kv_cache_dtype, k_scale)` and
`vllm::unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, layer_name, ...)`, with
`q [T, H, qk_nope + rope]` the per-head query (rope applied), `kv_c_normed [T, kv_lora_rank]` the
latent, `k_pe [T, 1, rope]` the shared rope key and `output [T, H * v_head_dim]`. Its backends (the
`MLACommonBackend` family) keep one cache per layer, `[num_blocks, block_size, kv_lora_rank + rope]`:
each row the latent then the rope key (`concat_and_cache_mla`; 0.33 allocates it as a `[num_blocks, 1,
block_size, L + R]` page and `MLAAttention.bind_kv_cache` squeezes the head). Inside the op vLLM runs
decode tokens absorbed (`W_UK_T` folded into the query, `W_UV` applied to the latent output: `forward_mqa`) and
prefill tokens un-absorbed (`kv_b_proj` decompresses per-head K and V: `forward_mha`). Both are the
same attention, `softmax(scale * q . k) v` with `k = [W_UK kv_c, k_pe]`, `v = W_UV kv_c`; the absorbed
form computes it for every token, prefill included, so the rewrite is, per layer:

    q_nope, q_pe = q[..., :qk_nope], q[..., qk_nope:]
    latent = ascend.mla_attention(bmm(q_nope^T, W_UK_T)^T, q_pe, cache[..., :L], cache[..., L:], ...)
    output.copy_(flatten(bmm(latent^T, W_UV)^T))

and the cache update becomes `ascend.mla_cache_write(kv_c_normed, k_pe, cache[..., :L], cache[..., L:],
slot_mapping)`. `W_UK_T [H, qk_nope, L]` and `W_UV [H, L, v_head_dim]` are the layer's own (made by its
`process_weights_after_loading`), provided inputs used in place.

`MLACommonMetadata` has no per-request `seq_lens`: the decodes' are `decode.seq_lens`; a prefill's is
its query length plus its cached context: vLLM 0.23's sum of its chunks (`prefill.chunked_context.seq_lens`,
`[num_chunks, num_prefills]`), vLLM 0.33's `prefill.chunked_context.context_lens` (`[num_prefills]`);
no context when `chunked_context` is None. The block table is the
decodes' rows then the prefills'. Requests are ordered decodes first (vLLM's builder requires it).
The readers run once per step (`binder.py`'s provided inputs).

Refused at compile time, naming the layer: a backend outside `SUPPORTED_MLA_BACKENDS`, sparse MLA
(DeepSeek-V3.2's indexer), a quantized cache or computed KV scales, decode or prefill context
parallelism, vLLM 0.33's HiSparse host-backed cache, non-causal metadata, and a layer without the
absorbed weights (ROCm's quantized bmm paths keep others).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from ...passes.fx_utils import example_value, is_op, node_arg
from ...passes.providers import fake_like, fresh_size
from .context import step_semantics
from .layers import UNQUANTIZED_CACHE_DTYPES, UnsupportedAttention, backend_refusal, refuse_cache_dtype

MLA_ATTENTION_OP = "unified_mla_attention_with_output"
MLA_CACHE_UPDATE_OP = "unified_mla_kv_cache_update"
#: The MLA backends whose metadata (`MLACommonMetadata`, from `MLACommonMetadataBuilder`) and cache
#: layout (`MLACommonBackend.get_kv_cache_shape`) the rewrite reads: each subclasses
#: `MLACommonBackend` without changing either (vLLM 0.23.0, `vllm/v1/attention/backends/mla/`).
SUPPORTED_MLA_BACKENDS = {
    "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend": "TRITON_MLA",
    "vllm.v1.attention.backends.mla.flashattn_mla.FlashAttnMLABackend": "FLASH_ATTN_MLA",
    "vllm.v1.attention.backends.mla.flashmla.FlashMLABackend": "FLASHMLA",
    "vllm.v1.attention.backends.mla.cutlass_mla.CutlassMLABackend": "CUTLASS_MLA",
    "vllm.v1.attention.backends.mla.flashinfer_mla.FlashInferMLABackend": "FLASHINFER_MLA",
}


def _vllm_op(name: str) -> Any:
    try:
        return getattr(torch.ops.vllm, name)
    except (AttributeError, RuntimeError):
        return None


def mla_graph_nodes(gm: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """The graph's vLLM MLA attention and MLA cache-update nodes."""
    attention, update = _vllm_op(MLA_ATTENTION_OP), _vllm_op(MLA_CACHE_UPDATE_OP)
    return ([n for n in gm.graph.nodes if attention is not None and is_op(n, attention)],
            [n for n in gm.graph.nodes if update is not None and is_op(n, update)])


# ---------------------------------------------------------------- what an MLA layer asks for


def refusal(layer: Any) -> str | None:
    """Why the rewrite cannot serve vLLM MLA layer `layer`, or None if it can."""
    unsupported = backend_refusal(layer, SUPPORTED_MLA_BACKENDS, "MLA attention backend")
    if unsupported:
        return unsupported
    if getattr(layer, "use_sparse", False) or getattr(layer, "indexer", None) is not None:
        return "sparse MLA (layer.use_sparse: DeepSeek-V3.2's top-k indexer)"
    dtype = getattr(layer, "kv_cache_dtype", "auto")
    if dtype not in UNQUANTIZED_CACHE_DTYPES:
        return f"quantized KV cache (kv_cache_dtype={dtype!r})"
    if getattr(layer, "calculate_kv_scales", False):
        return "computed KV scales (layer.calculate_kv_scales)"
    config = getattr(layer, "_vllm_config", None)
    dcp = getattr(getattr(config, "parallel_config", None), "decode_context_parallel_size", 1)
    if dcp > 1:
        return f"decode context parallelism (decode_context_parallel_size={dcp})"
    if getattr(layer, "use_pcp", False):  # vLLM 0.33
        return "prefill context parallelism (layer.use_pcp: prefill_context_parallel_size > 1)"
    if getattr(layer, "hisparse_cache", None) is not None:  # vLLM 0.33
        return "a HiSparse host-backed cache (layer.hisparse_cache)"
    if not (isinstance(getattr(layer, "W_UK_T", None), torch.Tensor)
            and isinstance(getattr(layer, "W_UV", None), torch.Tensor)):
        return "no absorbed weights (layer.W_UK_T / layer.W_UV: quantized kv_b_proj bmm, or weights not loaded)"
    return None


def refuse_unsupported(layers: dict[str, Any]) -> None:
    """Raise `UnsupportedAttention` for the first of `layers` (name -> vLLM MLA layer) the rewrite cannot serve."""
    for name, layer in layers.items():
        reason = refusal(layer)
        if reason is not None:
            raise UnsupportedAttention(name, reason)


def has_latent_cache(kv_cache: Any) -> bool:
    """Whether an MLA layer's cache is bound: `[num_blocks, block_size, kv_lora_rank + rope]`."""
    return isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 and kv_cache.numel() > 0


# ---------------------------------------------------------------- the per-step readers


def _refuse_metadata(layer: str, metadata: Any) -> None:
    missing = [f for f in ("num_reqs", "num_decodes", "num_prefills", "decode", "prefill", "query_start_loc")
               if not hasattr(metadata, f)]
    if missing:
        raise UnsupportedAttention(layer, f"MLA attention metadata {type(metadata).__qualname__} without {missing}")
    semantics = step_semantics(metadata)  # vLLM 0.33's MLACommonMetadata has `causal`
    if semantics is not None:
        raise UnsupportedAttention(layer, semantics)


def seq_lens(metadata: Any) -> torch.Tensor:
    """Every request's KV length, decodes first: `decode.seq_lens`, then each prefill's query length
    plus its cached context (the sum of its chunks)."""
    parts = []
    if metadata.decode is not None:
        parts.append(metadata.decode.seq_lens[: metadata.num_decodes])
    if metadata.prefill is not None:
        n = metadata.num_prefills
        loc = metadata.prefill.query_start_loc
        lens = loc[1 : n + 1] - loc[:n]
        chunked = metadata.prefill.chunked_context
        if chunked is not None:  # vLLM 0.33: per prefill; 0.23: per chunk and prefill, summed over the chunks
            context = chunked.context_lens if hasattr(chunked, "context_lens") else chunked.seq_lens.sum(dim=0)
            lens = lens + context[:n].to(lens.device, non_blocking=True)
        parts.append(lens.to(torch.int32))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def block_table(metadata: Any) -> torch.Tensor:
    """Every request's block-table row, decodes first."""
    parts = []
    if metadata.decode is not None:
        parts.append(metadata.decode.block_table[: metadata.num_decodes])
    if metadata.prefill is not None:
        parts.append(metadata.prefill.block_table[: metadata.num_prefills])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def query_start_loc(metadata: Any) -> torch.Tensor:
    return metadata.query_start_loc[: metadata.num_reqs + 1]


def latent_caches(kv_cache: torch.Tensor, kv_lora_rank: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent and rope halves of an MLA cache row, as views: `[..., :L]` and `[..., L:]`."""
    if not (isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 and kv_cache.shape[2] > kv_lora_rank):
        raise ValueError(f"{where}: expected a [num_blocks, block_size, kv_lora_rank + rope] tensor "
                         f"(kv_lora_rank {kv_lora_rank}), got "
                         f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]


# ---------------------------------------------------------------- the rewrite


class MlaRewrite:
    """Rewrites one graph's vLLM MLA nodes (see the module docstring); `provide(name, source, read,
    fake)` adds a provided input (`binder.py`), `layer_name(node)` reads a node's layer and
    `slot_mapping(layer, tokens)` binds the layer's cache-write slots."""

    def __init__(self, gm: fx.GraphModule, ctx: Any, fake_mode: Any, provide: Callable[..., fx.Node],
                 layer_name: Callable[[fx.Node], str], slot_mapping: Callable[[str, Any], fx.Node]) -> None:
        self.gm, self.ctx, self.fake_mode, self.provide = gm, ctx, fake_mode, provide
        self.layer_name, self.slot_mapping = layer_name, slot_mapping
        self.groups: dict[int, dict[str, fx.Node]] = {}
        self.group_layers: list[str] = []  # one layer per metadata group bound
        self.caches: dict[str, tuple[fx.Node, fx.Node]] = {}

    def rewrite(self, attention: list[fx.Node], updates: list[fx.Node]) -> list[str]:
        """Rewrite every node; returns one layer per metadata group bound."""
        graph = self.gm.graph
        for node in updates:
            layer = self.layer_name(node)
            kv_c, k_pe = node.args[0], node.args[1]
            kv_c_cache, k_pe_cache = self._cache_inputs(layer)
            slots = self.slot_mapping(layer, example_value(kv_c).shape[0])
            with graph.inserting_before(node):
                rows = graph.call_function(torch.ops.aten.flatten.using_ints, (k_pe, 1))  # [T, 1, R] -> [T, R]
                graph.call_function(torch.ops.ascend.mla_cache_write.default, (kv_c, rows, kv_c_cache, k_pe_cache, slots))
                dummy = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                            {"dtype": example_value(kv_c).dtype, "device": example_value(kv_c).device})
            node.replace_all_uses_with(dummy)
            graph.erase_node(node)
        for node in attention:
            self._rewrite_attention(node)
        return self.group_layers

    def _rewrite_attention(self, node: fx.Node) -> None:
        for position, name in ((5, "output_scale"), (6, "output_block_scale")):
            if node_arg(node, position, name) is not None:
                raise ValueError(f"{node.name}.{name}: fused output quantization is not supported by ascend_graph")
        layer_name = self.layer_name(node)
        layer = self.ctx.no_compile_layers[layer_name]
        q, output = node.args[0], node.args[3]
        metadata = self._metadata_inputs(layer_name)
        kv_c_cache, k_pe_cache = self._cache_inputs(layer_name)
        w_uk_t, w_uv = self._weights(layer_name, layer)
        nope, rope = int(layer.qk_nope_head_dim), int(layer.qk_rope_head_dim)
        aten, graph = torch.ops.aten, self.gm.graph
        with graph.inserting_before(node):
            q_nope = graph.call_function(aten.slice.Tensor, (q, -1, 0, nope))
            q_pe = graph.call_function(aten.slice.Tensor, (q, -1, nope, nope + rope))
            heads_first = graph.call_function(aten.transpose.int, (q_nope, 0, 1))  # [H, T, nope]
            absorbed = graph.call_function(aten.bmm.default, (heads_first, w_uk_t))  # [H, T, L]
            q_latent = graph.call_function(aten.transpose.int, (absorbed, 0, 1))  # [T, H, L]
            latent = graph.call_function(torch.ops.ascend.mla_attention.default, (
                q_latent, q_pe, kv_c_cache, k_pe_cache, metadata["block_table"], metadata["seq_lens"],
                metadata["query_start_loc"], float(layer.impl.scale)))
            up = graph.call_function(aten.bmm.default, (graph.call_function(aten.transpose.int, (latent, 0, 1)), w_uv))
            result = graph.call_function(aten.flatten.using_ints, (graph.call_function(aten.transpose.int, (up, 0, 1)), 1))
            graph.call_method("copy_", (output, result))
        latent.meta["ascend_adapted_from"] = f"vllm.{MLA_ATTENTION_OP} ({node.name}, layer {layer_name!r})"
        graph.erase_node(node)

    def _metadata_inputs(self, layer: str) -> dict[str, fx.Node]:
        """The metadata inputs of one metadata object (every layer sharing it)."""
        metadata = self.ctx.attn_metadata[layer]
        _refuse_metadata(layer, metadata)
        key = id(metadata)
        if key in self.groups:
            return self.groups[key]
        index = len(self.groups)
        where = f"forward_context.attn_metadata[{layer!r}]"
        seqs = fresh_size(self.fake_mode, metadata.num_reqs, f"mla_seqs_{index}")
        table = block_table(metadata)

        def read(fn: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
            return lambda ctx: fn(ctx.attn_metadata[layer])

        self.group_layers.append(layer)
        self.groups[key] = {
            "seq_lens": self.provide(
                f"vllm_mla_seq_lens_{index}", f"{where}: decode.seq_lens, then each prefill's query and context lengths",
                read(seq_lens), fake_like(self.fake_mode, seq_lens(metadata), (seqs,))),
            "query_start_loc": self.provide(
                f"vllm_mla_query_start_loc_{index}", f"{where}.query_start_loc[:num_reqs + 1]", read(query_start_loc),
                fake_like(self.fake_mode, metadata.query_start_loc, (seqs + 1,))),
            "block_table": self.provide(
                f"vllm_mla_block_table_{index}", f"{where}: decode.block_table, then prefill.block_table",
                read(block_table), fake_like(self.fake_mode, table, (seqs, table.shape[1]))),
        }
        return self.groups[key]

    def _cache_inputs(self, layer: str) -> tuple[fx.Node, fx.Node]:
        if layer in self.caches:
            return self.caches[layer]
        attn_layer = self.ctx.no_compile_layers[layer]
        rank = int(attn_layer.kv_lora_rank)
        where = f"forward_context.no_compile_layers[{layer!r}].kv_cache"
        kv_c, k_pe = latent_caches(attn_layer.kv_cache, rank, where)
        refuse_cache_dtype(layer, kv_c)
        name = layer.replace(".", "_")

        def half(i: int) -> Callable[[Any], torch.Tensor]:
            return lambda ctx: latent_caches(ctx.no_compile_layers[layer].kv_cache, rank, where)[i]

        self.caches[layer] = (
            self.provide(f"vllm_kv_c_cache_{name}", f"{where}[..., :{rank}] (latent)", half(0),
                         fake_like(self.fake_mode, kv_c)),
            self.provide(f"vllm_k_pe_cache_{name}", f"{where}[..., {rank}:] (rope key)", half(1),
                         fake_like(self.fake_mode, k_pe)))
        return self.caches[layer]

    def _weights(self, layer: str, attn_layer: Any) -> tuple[fx.Node, fx.Node]:
        """The layer's absorbed weights `W_UK_T` and `W_UV`, used in place."""
        name = layer.replace(".", "_")
        where = f"forward_context.no_compile_layers[{layer!r}]"
        return tuple(self.provide(f"vllm_{field.lower()}_{name}", f"{where}.{field}",
                                  lambda ctx, field=field: getattr(ctx.no_compile_layers[layer], field),
                                  fake_like(self.fake_mode, getattr(attn_layer, field)))
                     for field in ("W_UK_T", "W_UV"))
