"""vLLM's own model, attention layer, ops and forward context (0.23.0 or 0.33.0), run on the CPU.

What stands in for the GPU (and nothing else): a platform forced through
`vllm.platforms._current_platform` (auto-detection gives `UnspecifiedPlatform`, which has no
attention backend) that names vLLM's FLASH_ATTN backend and dispatches vLLM's ops on the CPU, and
pure-torch bodies for the two CUDA-only kernel calls of `FlashAttentionImpl` (`forward`: the
`flash_attn_varlen_func` call, `do_kv_cache_update`: `reshape_and_cache_flash`). Everything else is
vLLM's: `ModelConfig` from a tiny Llama `config.json` written here, `VllmConfig`,
`LlamaForCausalLM`, `Attention`, `torch.ops.vllm.unified_*`, `set_forward_context`,
`FlashAttentionMetadata`, world-size-1 gloo groups on a file store, `process_weights_after_loading`,
and vLLM's compile call (`compilation_config.init_backend` + `model.compile(fullgraph=True)`, as
`GPUModelRunner.load_model` does under mode 1).

Importing this module needs vLLM (`tests/test_vllm_real.py` skips without it): `.ci/run` builds the
venvs it runs in (`.venv-vllm`: torch 2.13.0 CPU, vLLM 0.23.0; `.venv-vllm33`: torch 2.14.1, vLLM
0.33.0; each vLLM with `--no-deps` and the pure-Python packages its imports need).
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

import vllm.platforms
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
BACKEND = "ascend_compile.integrations.vllm.vllm_backend"
LAYER = "model.layers.{}.self_attn.attn"


class CpuFlashAttnPlatform(Platform):
    """A platform for vLLM's CUDA code paths on the CPU: FLASH_ATTN attention (or `attention_backend`,
    a backend class's qualified name), ops on the CPU dispatch key."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    attention_backend = FLASH_ATTN

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
                             ) -> str:
        return cls.attention_backend

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(8, 0)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        """One unit (TRITON_MLA's impl reads it to size its decode splits)."""
        return 1

    @classmethod
    def use_custom_op_collectives(cls) -> bool:
        """As CUDA's: collectives through `torch.ops.vllm.all_reduce` and its kin."""
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        """As CUDA's: the model calls `torch.ops.vllm.unified_*` (not the Python functions)."""
        return True

    @classmethod
    def get_punica_wrapper(cls) -> str:
        """LoRA's punica ops in pure torch (`tests/vllm_lora.py`)."""
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


vllm.platforms._current_platform = CpuFlashAttnPlatform()

from vllm.config import (CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
from vllm.distributed import parallel_state  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.utils import get_model_architecture, process_weights_after_loading  # noqa: E402
from vllm.v1.attention import selector  # noqa: E402
from vllm.v1.attention.backends import flash_attn  # noqa: E402

from tests.helpers import write_flash_kv_cache  # noqa: E402

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 128,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


# ---------------------------------------------------------------- the two CUDA-only kernel calls


def key_value_caches(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttentionImpl's key and value caches, `[num_blocks, block_size, kv_heads, head_dim]` views of
    its layer's cache, split as each release splits it: 0.23's `[num_blocks, 2, block_size, kv_heads,
    head_dim]` by `kv_cache.unbind(1)`, 0.33's `[num_blocks, kv_heads, block_size, 2 * head_dim]` page by
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`."""
    if kv_cache.dim() == 5:
        return kv_cache.unbind(1)
    return kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)


def _kv_cache_update(self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """`reshape_and_cache_flash`: `slot_mapping`'s length is the number of real tokens; -1 is skipped."""
    write_flash_kv_cache(key, value, *key_value_caches(self, kv_cache), slot_mapping)


def _forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
             output_block_scale: Any = None) -> torch.Tensor:
    """`flash_attn_varlen_func` over the paged cache, causal, for the first `num_actual_tokens` rows,
    with what FlashAttentionImpl passes it: `window_size=self.sliding_window` (`(left, right)`: the
    query at position p attends keys in [p - left, p + right], -1 unbounded, causal keeping right at
    0), `softcap=
    self.logits_soft_cap` (0: none; `softcap * tanh(s / softcap)` of the scaled logits) and
    `s_aux=self.sinks` (one logit per query head in the softmax denominator)."""
    if attn_metadata is None:  # vLLM's profiling run
        return output.fill_(0)
    key_cache, value_cache = key_value_caches(self, kv_cache)
    block_size = key_cache.shape[1]
    assert attn_metadata.causal and self.sliding_window[1] in (0, -1), "causal attention only"
    left = self.sliding_window[0]
    loc = attn_metadata.query_start_loc.tolist()
    for i, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
        start, end = loc[i], loc[i + 1]
        if end == start:
            continue
        blocks = attn_metadata.block_table[i, : -(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(self.num_queries_per_kv, dim=1)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(self.num_queries_per_kv, dim=1)
        q = query[start:end]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scale
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        rows, cols = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
        masked = cols > rows  # causal (FlashAttentionImpl passes `causal=attn_metadata.causal`, True here)
        if left >= 0:
            masked |= cols < rows - left
        scores.masked_fill_(masked, float("-inf"))
        if self.sinks is not None:  # a value-less column per head
            sink = self.sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(output.dtype)
    return output


flash_attn.FlashAttentionImpl.forward = _forward
flash_attn.FlashAttentionImpl.do_kv_cache_update = _kv_cache_update


# ---------------------------------------------------------------- config, process groups, model


def gemma2(**overrides: Any) -> dict[str, Any]:
    """A tiny Gemma 2 `config.json` (attention logits soft-capped; `layer_types` chooses sliding layers)."""
    return {**TINY_LLAMA, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "query_pre_attn_scalar": 16,
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "sliding_window": 32, "layer_types": ["full_attention", "full_attention"], "tie_word_embeddings": True,
            **overrides}


def vllm_config(model_dir: Path, compile_mode: int = 0, max_model_len: int = 256, block_size: int = 16,
                hf_config: dict[str, Any] | None = None, cache_dtype: str = "auto", lora_config: Any = None
                ) -> VllmConfig:
    """vLLM's config for a tiny model written to `model_dir` (`hf_config`, default `TINY_LLAMA`);
    mode 1 (stock torch.compile) names our backend; `lora_config`: vLLM's `LoRAConfig`, if any."""
    (model_dir / "config.json").write_text(json.dumps(hf_config or TINY_LLAMA))
    model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=max_model_len)
    compilation = CompilationConfig(mode=compile_mode, custom_ops=["none"], cudagraph_mode="NONE",
                                    **({"backend": BACKEND} if compile_mode == 1 else {}))
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
                      scheduler_config=SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
                      compilation_config=compilation, **({"lora_config": lora_config} if lora_config else {}))


def init_process_groups(config: VllmConfig) -> None:
    """vLLM's world-size-1 process groups (gloo, on a file store), once per process."""
    if parallel_state._WORLD is not None:
        return
    store = Path(tempfile.mkdtemp(prefix="vllm_store_")) / "store"
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store}",
                                                    local_rank=0, backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)


@dataclasses.dataclass
class Model:
    """A tiny `LlamaForCausalLM` built by vLLM under `config`, with its KV caches bound."""

    config: VllmConfig
    model: torch.nn.Module
    num_blocks: int
    block_size: int

    @property
    def layers(self) -> dict[str, Any]:
        """The attention layers (vLLM's static forward context also holds MoE layers)."""
        return attention_layers(self.config)

    def caches(self) -> list[torch.Tensor]:
        return [layer.kv_cache for layer in self.layers.values()]


def attention_layers(config: VllmConfig) -> dict[str, Any]:
    return {name: layer for name, layer in config.compilation_config.static_forward_context.items()
            if hasattr(layer, "attn_backend")}


def build(config: VllmConfig, seed: int = 0, num_blocks: int = 64) -> Model:
    """The config's model class from vLLM's registry (`get_model_architecture`), with seeded weights
    (`process_weights_after_loading` run) and its KV caches allocated and bound as vLLM's runner does
    (`bind_caches`)."""
    init_process_groups(config)
    selector._cached_get_attn_backend.cache_clear()  # the platform's `attention_backend` may have changed
    with set_current_vllm_config(config):
        torch.manual_seed(seed)
        model_cls, _ = get_model_architecture(config.model_config)
        model = model_cls(vllm_config=config, prefix="")
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.2)
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    bind_caches(config, num_blocks)
    return Model(config, model.eval(), num_blocks, config.cache_config.block_size)


def bind_caches(config: VllmConfig, num_blocks: int) -> None:
    """Every attention layer's KV cache, zeroed, as vLLM's runner allocates and binds it.

    vLLM 0.23: a tensor per layer in its backend's `get_kv_cache_shape` (FLASH_ATTN's
    `[num_blocks, 2, block_size, kv_heads, head_dim]`, MLA's `[num_blocks, block_size, L + R]`) and the
    dtype of its `get_kv_cache_spec`, set as `layer.kv_cache`. vLLM 0.33 (no `get_kv_cache_shape`):
    one int8 allocation viewed as a `[num_blocks, H, block_size, bytes]` page per layer in the layout
    its backends resolve to (`get_supported_kv_cache_layouts`; FLASH_ATTN's default `LBNHC`), by vLLM's
    own `allocate_kv_cache`, and bound by each layer's `bind_kv_cache` (MLA squeezes its one head)."""
    layers = attention_layers(config)
    block_size = config.cache_config.block_size
    if all(hasattr(layer.attn_backend, "get_kv_cache_shape") for layer in layers.values()):
        for layer in layers.values():
            shape = layer.attn_backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=layer.get_kv_cache_spec(config).dtype)
        return
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache

    specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
    pages = [spec.page_size_bytes * num_blocks for spec in specs.values()]
    size, offsets = sum(pages), [sum(pages[:i]) for i in range(len(pages))]
    tensors = [KVCacheTensor(size=size, layers=[name], layer_stride=page, block_stride=page // num_blocks,
                             offset=offset) for name, page, offset in zip(specs, pages, offsets)]
    groups = [KVCacheGroupSpec([name], spec) for name, spec in specs.items()]
    layout = get_supported_kv_cache_layouts([layer.attn_backend for layer in layers.values()])[0]
    caches = allocate_kv_cache(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups),
                               torch.device("cpu"), layout)
    bind_kv_cache(caches, config.compilation_config.static_forward_context, [])


def compile_as_vllm(model: Model) -> None:
    """`GPUModelRunner.load_model`'s mode-1 compile: `init_backend`, then `model.compile(fullgraph=True)`."""
    with set_current_vllm_config(model.config):
        backend = model.config.compilation_config.init_backend(model.config)
        model.model.compile(fullgraph=True, backend=backend)


# ---------------------------------------------------------------- one step's metadata


@dataclasses.dataclass
class Step:
    """One batch: per request its KV length after this step and its number of new tokens."""

    seq_lens: list[int]
    query_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self) -> torch.Tensor:
        return torch.tensor([p for s, q in zip(self.seq_lens, self.query_lens) for p in range(s - q, s)])

    def input_ids(self, vocab: int) -> torch.Tensor:
        return torch.randint(0, vocab, (self.num_tokens,), generator=torch.Generator().manual_seed(self.num_tokens))

    def block_table(self, model: Model, width: int) -> torch.Tensor:
        """Request i owns blocks [i * width, (i + 1) * width): distinct per request, stable across steps."""
        return (torch.arange(len(self.seq_lens) * width, dtype=torch.int32).view(-1, width)) % model.num_blocks

    def layout(self, model: Model) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """The batch's block table (as wide as max_model_len), query_start_loc and new tokens' cache slots."""
        width = model.config.model_config.max_model_len // model.block_size
        table = self.block_table(model, width)
        loc = [0]
        for n in self.query_lens:
            loc.append(loc[-1] + n)
        slots = torch.tensor([int(table[b, p // model.block_size]) * model.block_size + p % model.block_size
                              for b, (s, q) in enumerate(zip(self.seq_lens, self.query_lens))
                              for p in range(s - q, s)], dtype=torch.int64)
        return table, loc, slots

    def metadata(self, model: Model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(attn_metadata, slot_mapping) per layer, as vLLM's runner passes them to `set_forward_context`."""
        table, loc, slots = self.layout(model)
        fields = {f.name for f in dataclasses.fields(flash_attn.FlashAttentionMetadata)}
        cascade = {"use_cascade": False, "common_prefix_len": 0, "cu_prefix_query_lens": None, "prefix_kv_lens": None,
                   "suffix_kv_lens": None}  # vLLM 0.23's cascade fields (0.33 has none)
        meta = flash_attn.FlashAttentionMetadata(
            num_actual_tokens=self.num_tokens, max_query_len=max(self.query_lens),
            query_start_loc=torch.tensor(loc, dtype=torch.int32), max_seq_len=max(self.seq_lens),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32), block_table=table, slot_mapping=slots,
            **{name: value for name, value in cascade.items() if name in fields})
        return {name: meta for name in model.layers}, {name: slots for name in model.layers}


def compiled_and_eager(monkeypatch: Any, where: Any, build_fn: Callable[..., Model], hf_config: Any = None,
                       options: dict | None = None, **config: Any) -> list[Model]:
    """vLLM's model built twice by `build_fn` (seed 3) under `where`: the first compiled through vLLM's
    own mode-1 call, the second eager; `options` go to ASCEND_COMPILE_OPTIONS."""
    if options is not None:
        monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps(options))
    models = []
    for mode in (1, 0):
        path = where / f"mode{mode}"
        path.mkdir(exist_ok=True)
        models.append(build_fn(vllm_config(path, compile_mode=mode, hf_config=hf_config, **config), seed=3))
    compile_as_vllm(models[0])
    return models


def run(model: Model, step: Step, fn: Any = None) -> torch.Tensor:
    """One forward of `step` under vLLM's forward context (`fn`: the model or its compiled self)."""
    attn_metadata, slot_mapping = step.metadata(model)
    fn = fn or model.model
    vocab = model.config.model_config.get_vocab_size()
    with torch.no_grad(), set_forward_context(attn_metadata, model.config, slot_mapping=slot_mapping):
        return fn(step.input_ids(vocab), step.positions())


def profile_run(model: Model, num_tokens: int = 8) -> torch.Tensor:
    """vLLM's profiling run: a forward with no attention metadata (before the KV caches are sized)."""
    with torch.no_grad(), set_forward_context(None, model.config, num_tokens=num_tokens):
        return model.model(torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens))
