"""Serving transformers' continuous batching (`model.generate_batch`) through `ascend_graph`.

`continuous_batching(model, cb_config, **options)` returns a `ContinuousBatchingConfig` whose step
function is compiled by this backend. Per layer, the attention function writes the step's keys
and values into the paged cache with `ascend.reshape_and_cache` and attends with `ascend.attention`;
the block table, sequence lengths and query offsets it derives from what continuous batching passes
(cumulative lengths and cache read indices) are hoisted by the compiler into a per-step host
prologue, so the step has no graph break and every bucket is one captured graph.

The touches of transformers' internals, all here: the cache's per-layer `update` (which would
gather the whole KV and breaks the graph) is made to hand the attention function its page views
instead, for models using this module's attention only; the padding granularity of continuous
batching is set to one token, since the backend pads to its own buckets; and the model runner's
compiled step (`ModelRunner._compiled_varlen`, which transformers makes with `torch.compile`) is
made with `ascend_compile.compile` instead, its step dims named (`STEP_DIMS`), for runners whose
config carries this module's backend: one dynamo graph for every step (plain `torch.compile(dynamic=
True)` traced 3 to 4: static sizes first, sizes 0 and 1 and equal sizes specialised), and
`dispatch="direct"` available.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from .. import backend as ascend_backend
from .. import compile_once
from ..config import CompileConfig as AscendConfig
from ..ops import library  # noqa: F401  (registers torch.ops.ascend)
from ..torch_support import torch_release

#: The attention implementation name; continuous batching accepts flash-named implementations.
ATTENTION = "ascend_paged_flash"
#: The transformers releases this module was written and tested against.
SUPPORTED_VERSIONS = ("5.24",)
#: Attention layer types whose cache this module can serve.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING = "sliding_attention"
#: The step dims of continuous batching's model inputs (`batch_data`): token dims of the ids and
#: positions, sequence dims of the query offsets and logits indices. The per-layer-type KV offsets
#: and the cache read and write indices (dicts and lists of them) are marked along dim 0 too.
STEP_DIMS = {"input_ids": 1, "position_ids": 1, "cu_seq_lens_q": 0, "logits_indices": 0, "logits_processor_args": 1}
#: The attribute of this module's backend that tells the patched model runner how to dispatch.
DISPATCH_ATTR = "ascend_dispatch"


def installed_version() -> str:
    """The installed transformers release."""
    import transformers

    return transformers.__version__


#: The oldest torch whose dynamo traces continuous batching's step: its sampler copies the step's tokens
#: into a static buffer, `output_ids[0, :tokens].copy_(next_tokens)` (transformers 5.24,
#: `continuous_batching/model_runner.py` `_sample`); torch 2.10 slices a static dim by a symbolic end
#: into a new data-dependent size, which the copy then cannot prove equal to the tokens' (measured:
#: "Could not guard on data-dependent expression Eq(u0, s3)", no step served).
OLDEST_TORCH = (2, 11)


def _check_version() -> None:
    if torch_release() < OLDEST_TORCH:
        raise RuntimeError(
            f"torch {torch.__version__}: ascend_compile.integrations.transformers needs torch "
            f"{'.'.join(map(str, OLDEST_TORCH))} or later: torch {torch.__version__}'s dynamo cannot trace continuous "
            f"batching's sampler (`output_ids[0, :tokens].copy_(next_tokens)`: a data-dependent slice); serve "
            f"through vLLM on this torch, or install torch 2.11 or later")
    version = installed_version()
    if not version.startswith(SUPPORTED_VERSIONS):
        raise RuntimeError(
            f"transformers {version}: ascend_compile.integrations.transformers supports transformers "
            f"{', '.join(v + '.x' for v in SUPPORTED_VERSIONS)} (it replaces the paged cache's per-layer update, "
            f"an internal); install a supported version"
        )


def _refuse_latent_attention(model: torch.nn.Module) -> None:
    """Refuse multi-head latent attention (DeepSeek-V2/V3 and their kin: a layer with a `kv_b_proj`
    and a `kv_lora_rank`), naming the first such layer and its head dims. transformers 5.24's layer
    (`DeepseekV3Attention.forward`) writes its compressed latent into the cache (`[kv_lora_rank]`
    keys, `[rope]` values per token, where the paged cache's pages hold `num_key_value_heads x
    head_dim`: continuous batching fails on it without this backend too) and attends with per-head
    keys of `qk_nope + rope` dims and values of `v_head_dim`; `ascend.attention` takes one head dim
    for query, key and value (`ops/validate.py: check_attention_tensors`)."""
    for name, module in model.named_modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "kv_lora_rank"):
            nope, rope = module.qk_nope_head_dim, module.qk_rope_head_dim
            raise ValueError(
                f"{name}: multi-head latent attention (query/key head dim {nope + rope} = qk_nope {nope} + rope "
                f"{rope}, value head dim {module.v_head_dim}, kv_lora_rank {module.kv_lora_rank}) is not supported "
                f"by the ascend_graph continuous batching integration: ascend.attention takes one head dim for "
                f"query, key and value, and continuous batching's paged cache does not hold the layer's latent "
                f"(transformers {installed_version()}); serve DeepSeek models through vLLM "
                f"(ascend_compile.integrations.vllm binds its MLA layers to ascend.mla_attention)"
            )


def _check_model(model: torch.nn.Module) -> None:
    _refuse_latent_attention(model)
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"model: layer types {unsupported} are not supported by the ascend_graph continuous batching "
            f"integration (it serves {list(SUPPORTED_LAYER_TYPES)})"
        )


def ring_length(sliding_window: int, max_batch_tokens: int, page_size: int) -> int:
    """The tokens a sliding layer's ring buffer holds per request under this module: every key a
    chunk of up to `max_batch_tokens` query tokens reads (`sliding_window + q - 1`), whole pages.

    Continuous batching's own ring holds `sliding_window` tokens and reads the window before a step
    writes over it; this module writes the step's keys first and attends from the cache, so the ring
    must not wrap inside a step; and a ring of whole pages makes logical block `j` of a sequence its
    ring page `j mod pages`, a block table like any other."""
    return -(-(sliding_window + max_batch_tokens - 1) // page_size) * page_size


def _cache_init(original: Callable) -> Callable:
    """The paged cache's constructor for models using `ATTENTION`: sliding layers' rings of
    `ring_length` tokens (the allocator's `sliding_window`, which only sizes its ring and indices;
    the model's layers keep their own window)."""

    def init(self, config, continuous_batching_config, *args, **kwargs):
        original(self, config, continuous_batching_config, *args, **kwargs)
        allocator = self.cache_allocators.get(SLIDING)
        if getattr(config, "_attn_implementation", None) != ATTENTION or allocator is None:
            return
        allocator.sliding_window = ring_length(config.sliding_window, self.max_batch_tokens, allocator.tokens_per_page)
        self.read_cache_limit = self._infer_read_cache_limit()

    init.ascend_original = original
    return init


def _page_update(original: Callable) -> Callable:
    """The cache's per-layer update for models using `ATTENTION`: nothing is gathered; the attention
    function gets this layer's page views and cache indices in `kwargs` (updated in place, as the
    original does)."""

    def update(self, key_states, value_states, layer_idx, kwargs):
        if self.config._attn_implementation != ATTENTION:
            return original(self, key_states, value_states, layer_idx, kwargs)
        allocator = self.layer_to_allocator[layer_idx]
        # One sampled token per sequence: tell the compiler the two counts are one size, so the
        # sampled rows are padded with the sequences instead of captured per distinct count.
        torch._check(kwargs["logits_indices"].shape[0] == kwargs["cu_seq_lens_q"].shape[0] - 1)
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type]
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        kwargs["ascend_pages"] = allocator._kv_page_views[layer_idx]  # the page views (sliding layers' too)
        kwargs["ascend_page_size"] = allocator.tokens_per_page
        kwargs["ascend_read_index"] = kwargs["read_index"][allocator.index]
        kwargs["ascend_write_index"] = kwargs["write_index"][allocator.index]
        kwargs["ascend_sentinel"] = allocator.sentinel_index if allocator.layer_type == SLIDING else None
        return key_states, value_states

    update.ascend_original = original
    return update


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Continuous batching's attention through the `ascend` ops: `query [1, H, T, D]`,
    `key/value [1, KVH, T, D]` (this step's tokens only) -> `[1, T, H, D]`."""
    if "ascend_pages" not in kwargs:
        raise RuntimeError(
            f"{ATTENTION}: serves continuous batching only (model.generate_batch with the config from "
            f"ascend_compile.integrations.transformers.continuous_batching)"
        )
    key_pages, value_pages = kwargs["ascend_pages"]
    page_size = kwargs["ascend_page_size"]
    tokens = query.shape[2]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).to(key_pages.dtype)
    v = value[0].transpose(0, 1).to(value_pages.dtype)
    write_index = kwargs["ascend_write_index"]
    torch.ops.ascend.reshape_and_cache(k, v, key_pages, value_pages, write_index)
    cu_k, cu_q = kwargs["cu_seq_lens_k"], kwargs["cu_seq_lens_q"]
    max_blocks = module.config.ascend_max_blocks
    window = kwargs.get("sliding_window") if kwargs["ascend_sentinel"] is not None else None
    if window is None:
        seq_lens = torch.diff(cu_k).to(torch.int32)
        block_table = _block_table(cu_k, seq_lens, kwargs["ascend_read_index"], write_index, page_size, max_blocks)
    else:
        seq_lens, block_table = _ring_block_table(cu_k, cu_q, kwargs["position_ids"], kwargs["ascend_read_index"],
                                                  write_index, kwargs["ascend_sentinel"], page_size, max_blocks)
    out = torch.ops.ascend.attention(q, key_pages, value_pages, block_table, seq_lens, cu_q.to(torch.int32),
                                     scaling if scaling is not None else q.shape[-1] ** -0.5,
                                     window=window, soft_cap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return out.view(1, tokens, *out.shape[1:]), None


def _ring_block_table(cu_k, cu_q, position_ids, read_index, write_index, sentinel: int, page_size: int,
                      max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(KV lengths, `[B, max_blocks]` block table) of a sliding layer's ring (`ring_length`).

    A sequence's KV length is its last query token's position + 1. Its read indices are the
    physical slots of the keys before this step's (the ring's last ones), then one sentinel per
    query token, whose slots are this step's write indices: with those put in, entry `i` of a
    sequence's read indices is the slot of position `L - k + i` (`k` its count). Each logical block
    `j` takes the page of its first position the sequence still holds (earlier blocks are outside
    the window and never read: they get the page of the first held position)."""
    query_lens = torch.diff(cu_q)
    last = position_ids[0, (cu_q[1:] - 1).clamp(min=0)].long() + 1
    seq_lens = torch.where(query_lens > 0, last, 0).to(torch.int32)
    held = torch.diff(cu_k).long()  # keys read this step: the ring's held ones, then the new ones
    # a batch that reads no cache passes no read indices: its sequences hold only their new keys
    # (cu_k == cu_q), which the write indices appended after the (empty) read ones give
    slots = torch.cat([read_index.masked_scatter(read_index == sentinel, write_index), write_index])
    offsets = cu_k[:-1].long()
    first_held = seq_lens.long() - held
    positions = (torch.arange(max_blocks, device=cu_k.device) * page_size)[None, :]
    positions = torch.maximum(positions, first_held[:, None]).minimum((seq_lens.long() - 1).clamp(min=0)[:, None])
    index = (offsets[:, None] + positions - first_held[:, None]).clamp(0, slots.shape[0] - 1)
    return seq_lens, (slots[index] // page_size).to(torch.int32)


def _block_table(cu_k, seq_lens, read_index, write_index, page_size: int, max_blocks: int) -> torch.Tensor:
    """`[B, max_blocks]` page ids of each sequence, from its cache read indices (one per KV token, in
    order, each page starting at a page boundary). A batch that reads no cache gets no read indices
    and reads what it writes: the positions then fall into the write indices appended after them."""
    index = torch.cat([read_index, write_index])
    blocks = torch.arange(max_blocks, device=cu_k.device) * page_size
    starts = cu_k[:-1, None].long() + blocks[None, :]
    valid = blocks[None, :] < seq_lens[:, None]
    pages = index[starts.clamp(max=index.shape[0] - 1)] // page_size
    return torch.where(valid, pages, 0).to(torch.int32)


def mark_step_dims(args: tuple, kwargs: dict) -> None:
    """Mark the step dims of one call of the runner's step, `(model, batch_data, carry_over_ids,
    prev_output_ids, output_ids)`, dynamic (`STEP_DIMS`; the rest of the sizes stay static)."""
    batch = args[1] if len(args) > 1 else kwargs["batch_data"]
    tensors = [(batch.get(name), dim) for name, dim in STEP_DIMS.items()]
    offsets = batch.get("cu_seq_lens_k")
    tensors += [(t, 0) for t in (offsets.values() if isinstance(offsets, dict) else [offsets])]
    tensors += [(t, 0) for t in [*batch.get("read_index", ()), *batch.get("write_index", ())]]
    for tensor, dim in tensors:
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _runner_init(original: Callable) -> Callable:
    """The model runner's constructor, which for a config carrying this module's backend makes the
    compiled step with `ascend_compile.compile` (one graph for every step, its dims named)."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        step_backend = getattr(self.cb_config.varlen_compile_config, "backend", None)
        dispatch = getattr(step_backend, DISPATCH_ATTR, None)
        if dispatch is not None:
            self._compiled_varlen = compile_once.compile(self._forward_process_and_sample, backend=step_backend,
                                                         step_dims=mark_step_dims, dispatch=dispatch, fullgraph=True)

    __init__.ascend_original = original
    return __init__


def _install() -> None:
    """Register the attention function, the page update and the runner's compiled step (once per process)."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    AttentionInterface.register(ATTENTION, attention_forward)
    if not hasattr(PagedAttentionCache.update, "ascend_original"):
        PagedAttentionCache.update = _page_update(PagedAttentionCache.update)
    if not hasattr(PagedAttentionCache.__init__, "ascend_original"):
        PagedAttentionCache.__init__ = _cache_init(PagedAttentionCache.__init__)
    if not hasattr(ModelRunner.__init__, "ascend_original"):
        ModelRunner.__init__ = _runner_init(ModelRunner.__init__)


def max_model_len_of(model: torch.nn.Module) -> int:
    """The longest sequence the model serves: its config's `max_position_embeddings`."""
    length = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 1:
        raise ValueError("max_model_len: the model config has no max_position_embeddings; pass max_model_len=...")
    return length


def continuous_batching(model: torch.nn.Module, config: Any = None, on_compiled: Callable | None = None,
                        dispatch: str = "dynamo", **options: Any):
    """A `ContinuousBatchingConfig` (a copy of `config`, or a default one) whose step function is
    compiled by `ascend_graph` with `options` (`max_model_len` defaults to the model's
    `max_position_embeddings`); the model is switched to this module's attention.

    `on_compiled` receives each compiled artifact (its `stats`, `describe()`, `memory_report()`);
    `dispatch` is `ascend_compile.compile`'s ("direct": each runner's steps after its first go
    straight to the graph; the values continuous batching keeps fixed for a runner, its flags and
    the cache's layout, are then not compared per step)."""
    if dispatch not in compile_once.DISPATCHES:
        raise ValueError(f"dispatch: expected one of {list(compile_once.DISPATCHES)}, got {dispatch!r}")
    _check_version()
    _check_model(model)
    from transformers import ContinuousBatchingConfig
    from transformers.generation.configuration_utils import CompileConfig

    _install()
    ascend_config = AscendConfig.from_options({"max_model_len": max_model_len_of(model), **options})
    cb = copy.deepcopy(config) if config is not None else ContinuousBatchingConfig()
    page_size = cb.page_size
    model.config.ascend_max_blocks = -(-ascend_config.max_model_len // page_size)
    # Set directly: `set_attn_implementation` would look for a flash kernel behind a flash-named
    # implementation, and continuous batching accepts only flash-named ones besides its own two.
    model.config._attn_implementation = ATTENTION
    # The backend pads each step to its own buckets: continuous batching pads by one token (none).
    cb.q_padding_interval_size = 1
    cb.kv_padding_interval_size = 1
    cb.max_blocks_per_request = 0  # the block-table decode path is flash_attn_with_kvcache's
    compiled = ascend_backend(ascend_config, on_compiled=on_compiled)
    setattr(compiled, DISPATCH_ATTR, dispatch)
    cb.varlen_compile_config = CompileConfig(fullgraph=True, dynamic=True, backend=compiled, mode=None)
    return cb
