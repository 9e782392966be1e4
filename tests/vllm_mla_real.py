"""vLLM's own DeepSeek-V2 model and MLA attention layer (0.23.0 or 0.33.0), run on the CPU (as
`tests/vllm_real.py` runs its Llama).

The platform is `vllm_real`'s, naming vLLM's TRITON_MLA backend (`TritonMLABackend`: its impl, its
metadata builder, `MLACommonMetadata`, the `[num_blocks, block_size, kv_lora_rank + rope]` cache).
What stands in for the GPU, and nothing else, are pure-torch bodies for the CUDA / Triton kernel calls
vLLM's MLA code makes:

- `concat_and_cache_mla` (`vllm._C`): the latent cache write of `MLAAttentionImpl.do_kv_cache_update`;
- `decode_attention_fwd` (Triton): the absorbed decode attention of `TritonMLAImpl.forward_mqa`
  (and `triton.next_power_of_2`, which sizes its splits, where vLLM's Triton placeholder lacks it);
- the prefill backend the layer takes (`get_mla_prefill_backend`, which finds no flash-attn on this
  platform: the choice is made here), which runs prefill un-absorbed (per-head K/V decompressed by
  `kv_b_proj`): on vLLM 0.33 its own `CPUSDPAMLAPrefillBackend` (pure torch: nothing stands in), on
  0.23 `FlashAttnPrefillBackend` with `flash_attn_varlen_func` (vLLM's FlashAttention) stood in;
- `gather_and_maybe_dequant_cache` (`vllm._C`) and `merge_attn_states` (Triton off CUDA): chunked
  prefill's read of the cached context and its merge with the new tokens' attention.

The metadata of a step is built by vLLM's own `TritonMLAMetadataBuilder.build` from a
`CommonAttentionMetadata`, as vLLM's runner builds it (requests ordered decodes first; its pinned
host tables as plain host memory).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from tests import vllm_real as real

from vllm import _custom_ops  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import mla_attention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla import triton_mla  # noqa: E402

TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"
LAYER = "model.layers.{}.self_attn.attn"
#: MLACommonMetadata accepts only cache rows of 320 or 576 (`MLACommonBackend.get_supported_head_sizes`,
#: checked in its `__post_init__`): kv_lora_rank 256 + rope 64 is the smaller.
KV_LORA_RANK, ROPE_DIM = 256, 64

TINY_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": ROPE_DIM, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 2,  # both layers dense: MoE is not what this tests
    "vocab_size": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float32", "tie_word_embeddings": False, "hidden_act": "silu",
}


# ---------------------------------------------------------------- the kernel calls


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q [Q, H, D], k [K, H, D], v [K, H, Dv] -> (out [Q, H, Dv], lse [H, Q]); causal
    aligns the queries with the last keys (flash-attn's convention); no keys: out 0, lse -inf."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        rows = torch.arange(k.shape[0] - q.shape[0], k.shape[0]).unsqueeze(1)
        scores.masked_fill_(torch.arange(k.shape[0]).unsqueeze(0) > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.float()), lse


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_cache_dtype: str, scale: torch.Tensor, skip_scale: bool = False) -> None:
    """`concat_and_cache_mla`: row `slot` of the `[num_blocks, block_size, L + R]` cache becomes
    `cat(kv_c, k_pe)`; slot -1 is skipped. The scale (and vLLM 0.33's `skip_scale`) only applies to a
    quantized cache, which these tests do not write."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = torch.cat((kv_c, k_pe), dim=-1)[: slot_mapping.shape[0]][valid]


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         lse: torch.Tensor, req_to_token: torch.Tensor, b_seq_len: torch.Tensor, attn_logits: Any,
                         num_kv_splits: int, sm_scale: float, page_size: int, **_: Any) -> None:
    """Triton's MLA decode: request i's one query `q[i]` [H, L + R] attends its `b_seq_len[i]` cached
    tokens (keys `k_buffer` [NB, BS, 1, L + R], values `v_buffer`, their first L dims), into `o` / `lse`."""
    for i, seq_len in enumerate(b_seq_len.tolist()):
        blocks = req_to_token[i, : -(-seq_len // page_size)].long()
        k = k_buffer[blocks].flatten(0, 1)[:seq_len].expand(-1, q.shape[1], -1)
        v = v_buffer[blocks].flatten(0, 1)[:seq_len].expand(-1, q.shape[1], -1)
        out, row_lse = _attend(q[i : i + 1], k, v, sm_scale, causal=False)
        o[i] = out[0].to(o.dtype)
        lse[i] = row_lse[:, 0].to(lse.dtype)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                           causal: bool, return_softmax_lse: bool = False, return_attn_probs: bool = False,
                           **_: Any) -> Any:
    """flash-attn's varlen attention: sequence i's queries `q[cu_q[i]:cu_q[i+1]]` attend its keys;
    returns out [Tq, H, Dv] and, when asked, lse [H, Tq]."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    loc_q, loc_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(loc_q) - 1):
        (qs, qe), (ks, ke) = loc_q[i : i + 2], loc_k[i : i + 2]
        if qe > qs:
            o, row_lse = _attend(q[qs:qe], k[ks:ke], v[ks:ke], softmax_scale, causal)
            out[qs:qe], lse[:, qs:qe] = o.to(out.dtype), row_lse
    return (out, lse) if return_softmax_lse or return_attn_probs else out


def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str, scale: torch.Tensor, seq_starts: torch.Tensor | None = None
                                   ) -> None:
    """Request i's cached tokens `seq_starts[i] + [0, n_i)` (n_i from `cu_seq_lens`) into `dst[cu[i]:cu[i+1]]`."""
    block_size = src_cache.shape[1]
    cu = cu_seq_lens.tolist()
    starts = seq_starts.tolist() if seq_starts is not None else [0] * (len(cu) - 1)
    for i in range(len(cu) - 1):
        positions = torch.arange(starts[i], starts[i] + cu[i + 1] - cu[i])
        blocks = block_table[i, positions // block_size].long()
        dst[cu[i] : cu[i + 1]] = src_cache[blocks, positions % block_size]


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor, output_lse: torch.Tensor | None = None,
                      prefill_tokens_with_context: int | None = None, output_scale: Any = None) -> None:
    """The LSE-weighted merge of two partial attentions (lse [H, T]); tokens from
    `prefill_tokens_with_context` on take the suffix as is."""
    merged = torch.logaddexp(prefix_lse, suffix_lse)
    prefix_weight = torch.exp(prefix_lse - merged).T.unsqueeze(-1)
    suffix_weight = torch.exp(suffix_lse - merged).T.unsqueeze(-1)
    result = prefix_output.float() * prefix_weight + suffix_output.float() * suffix_weight
    if prefill_tokens_with_context is not None:
        result[prefill_tokens_with_context:] = suffix_output[prefill_tokens_with_context:].float()
    output.copy_(result.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(merged)


_custom_ops.concat_and_cache_mla = concat_and_cache_mla
_custom_ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
triton_mla.decode_attention_fwd = decode_attention_fwd
if not hasattr(triton_mla.triton, "next_power_of_2"):  # vLLM's Triton placeholder (no Triton here)
    triton_mla.triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
mla_attention.merge_attn_states = merge_attn_states
try:  # vLLM 0.33: its own CPU prefill backend (dense per-request attention in torch), no stand-in
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as PREFILL_BACKEND
except ImportError:  # vLLM 0.23: FlashAttention's, its kernel call stood in
    from vllm.v1.attention.backends.mla.prefill import flash_attn as prefill_flash_attn

    prefill_flash_attn.flash_attn_varlen_func = flash_attn_varlen_func
    PREFILL_BACKEND = prefill_flash_attn.FlashAttnPrefillBackend
mla_attention.get_mla_prefill_backend = lambda vllm_config: PREFILL_BACKEND


# ---------------------------------------------------------------- model and steps


def build(config: Any, seed: int = 0, num_blocks: int = 64) -> real.Model:
    """`vllm_real.build` for an MLA model: the caches are `[num_blocks, block_size, L + R]`."""
    return real.build(config, seed=seed, num_blocks=num_blocks)


@contextlib.contextmanager
def _unpinned():
    """`torch.zeros` / `torch.empty` / `torch.tensor` with `pin_memory=True` as plain host memory: the
    builder pins its chunk tables (0.23: `torch.zeros(..., pin_memory=True)`; 0.33: `torch.empty` and
    `torch.tensor` with `pin_memory=PIN_MEMORY`), which needs an accelerator this machine does not have."""
    originals = {name: getattr(torch, name) for name in ("zeros", "empty", "tensor")}

    def unpinned(make: Any) -> Any:
        def call(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return make(*args, **kwargs)
        return call

    for name, make in originals.items():
        setattr(torch, name, unpinned(make))
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)


@dataclasses.dataclass
class Step(real.Step):
    """One batch, decodes first (vLLM's runner reorders MLA batches so: `split_decodes_and_prefills`)."""

    def metadata(self, model: real.Model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(attn_metadata, slot_mapping) per layer, the metadata built by vLLM's `TritonMLAMetadataBuilder`."""
        table, loc, slots = self.layout(model)
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor(loc, dtype=torch.int32), query_start_loc_cpu=torch.tensor(loc, dtype=torch.int32),
            seq_lens=seq_lens, num_reqs=len(self.seq_lens), num_actual_tokens=self.num_tokens,
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens), block_table_tensor=table,
            slot_mapping=slots, seq_lens_cpu_upper_bound=seq_lens.clone())
        names = list(model.layers)
        layer = model.layers[names[0]]
        builder = layer.attn_backend.get_builder_cls()(layer.get_kv_cache_spec(model.config), names, model.config,
                                                       torch.device("cpu"))
        with real.set_current_vllm_config(model.config), _unpinned():
            meta = builder.build(0, common)
        return {name: meta for name in names}, {name: slots for name in names}


def run(model: real.Model, step: Step, fn: Any = None) -> torch.Tensor:
    """One forward of `step` under vLLM's forward context."""
    return real.run(model, step, fn)
