"""Which vLLM attention layers the `ascend.attention` rewrite serves, and a refusal naming the rest.

The rewrite (`integrations/vllm.py`) reads a layer's `impl.scale`, its KV cache and the metadata's
lengths and block table, and computes plain causal decoder attention. Anything else a layer asks
of its kernel would be dropped silently and give wrong tokens: a sliding window, a logits soft-cap,
ALiBi slopes, attention sinks, encoder / encoder-decoder / non-causal attention, a quantized KV
cache, or a backend whose metadata carries other fields (FlashInfer, MLA, ...). Every such layer is
refused at compile time, the message naming the layer and the feature. Checked against vLLM 0.23.0
(`vllm/model_executor/layers/attention/attention.py`, `v1/attention/backends/flash_attn.py`) and
vLLM-Ascend 0.23.0 (`vllm_ascend/attention/attention_v1.py`).
"""
from __future__ import annotations

from typing import Any

import torch

#: The backends whose metadata and cache layout the rewrite reads, by class (their `get_name()` is
#: no identity: vLLM-Ascend's MLA, SFA and DSA backends also answer "CUSTOM" or "FLASH_ATTN").
SUPPORTED_BACKENDS = {
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend": "FLASH_ATTN",
    "vllm_ascend.attention.attention_v1.AscendAttentionBackend": "vLLM-Ascend's AscendAttentionBackend",
}
#: `kv_cache_dtype` values that store the model's own dtype (anything else is a quantized cache).
UNQUANTIZED_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", "float", "float32")
CACHE_TENSOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODER = "decoder"


class UnsupportedAttention(ValueError):
    """A vLLM attention layer asks for something `ascend.attention` does not compute."""

    def __init__(self, layer: str, feature: str) -> None:
        super().__init__(f"vLLM attention layer {layer!r}: {feature} is not supported by ascend_graph "
                         f"(its attention would be computed as plain causal attention); serve this model "
                         f"without the ascend_graph backend")
        self.layer, self.feature = layer, feature


def backend_path(backend: Any) -> str:
    """`module.QualName` of a layer's attention backend class."""
    cls = backend if isinstance(backend, type) else type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def refusal(name: str, layer: Any) -> str | None:
    """Why the rewrite cannot serve vLLM attention layer `layer` (named `name`), or None if it can."""
    backend = getattr(layer, "attn_backend", None)
    path = backend_path(backend) if backend is not None else "none"
    if path not in SUPPORTED_BACKENDS:
        label = backend.get_name() if hasattr(backend, "get_name") else "?"
        return (f"attention backend {path} (get_name() {label!r}); supported: "
                + ", ".join(SUPPORTED_BACKENDS.values()))
    impl = layer.impl
    window = _sliding_window(impl, layer)
    if window is not None:
        return f"sliding window ({window})"
    cap = getattr(impl, "logits_soft_cap", None)
    if cap:  # FlashAttention keeps 0 for "none", vLLM-Ascend keeps nothing
        return f"logits soft-cap (impl.logits_soft_cap={cap!r})"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi (impl.alibi_slopes)"
    if getattr(impl, "sinks", None) is not None or getattr(layer, "has_sink", False):
        return "attention sinks (impl.sinks)"
    kind = getattr(impl, "attn_type", DECODER)
    kind = getattr(kind, "value", kind)  # vLLM's AttentionType is a str enum
    if kind != DECODER:
        return f"attention type {kind!r} (only decoder self-attention)"
    for owner in (layer, impl):
        dtype = getattr(owner, "kv_cache_dtype", "auto")
        if dtype not in UNQUANTIZED_CACHE_DTYPES:
            return f"quantized KV cache (kv_cache_dtype={dtype!r})"
    return None


def _sliding_window(impl: Any, layer: Any) -> str | None:
    """The layer's window as `where=value`, or None: FlashAttention's impl keeps (-1, -1) for none,
    vLLM-Ascend's None; vLLM's `Attention` keeps the window it was built with."""
    window = getattr(impl, "sliding_window", None)
    if window is not None and window != (-1, -1):
        return f"impl.sliding_window={window!r}"
    if getattr(layer, "sliding_window", None) is not None:
        return f"layer.sliding_window={layer.sliding_window!r}"
    return None


def refuse_unsupported(layers: dict[str, Any]) -> None:
    """Raise `UnsupportedAttention` for the first of `layers` (name -> vLLM layer) the rewrite cannot serve."""
    for name, layer in layers.items():
        reason = refusal(name, layer)
        if reason is not None:
            raise UnsupportedAttention(name, reason)


def refuse_metadata(name: str, metadata: Any) -> None:
    """The per-step metadata's features: non-causal attention and fields the rewrite does not find."""
    if getattr(metadata, "causal", True) is False:
        raise UnsupportedAttention(name, "non-causal attention (attn_metadata.causal=False)")
    missing = [f for f in ("seq_lens", "query_start_loc") if not hasattr(metadata, f)]
    if not (hasattr(metadata, "block_table") or hasattr(metadata, "block_tables")):
        missing.append("block_table")
    if missing:
        raise UnsupportedAttention(name, f"attention metadata {type(metadata).__qualname__} without {missing}")


def refuse_cache_dtype(name: str, cache: torch.Tensor) -> None:
    """A KV cache tensor of a quantized element type (fp8 / int8 / uint8 storage)."""
    if cache.dtype not in CACHE_TENSOR_DTYPES:
        raise UnsupportedAttention(name, f"quantized KV cache (cache dtype {cache.dtype})")
