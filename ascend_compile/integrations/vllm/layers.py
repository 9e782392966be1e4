"""Which vLLM attention layers the `ascend.attention` rewrite serves, with which features, and a
refusal naming the rest.

The rewrite (`binder.py`) reads a layer's `impl.scale`, its KV cache, the metadata's
lengths and block table, and the layer's attention features (`layer_features`): a causal sliding
window, a logits soft-cap and attention sinks, which `ascend.attention` computes (`ops/features.py`;
a target whose kernels lack one refuses it at compile time, naming the layer: `passes/npu_checks.py`).
Anything else a layer asks of its kernel would be dropped silently and give wrong tokens: ALiBi
slopes, encoder / encoder-decoder / non-causal attention, a window reaching right of the query, a
quantized KV cache, or a backend whose metadata carries other fields (FlashInfer, MLA, ...). Every
such layer is refused at compile time, the message naming the layer and the feature. Checked
against vLLM 0.23.0 (`vllm/model_executor/layers/attention/attention.py`,
`v1/attention/backends/flash_attn.py`) and vLLM-Ascend (`vllm_ascend/attention/attention_v1.py`).
"""
from __future__ import annotations

from typing import Any

import torch

from ...ops.features import AttentionFeatures
from .context import step_semantics

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
                         f"(ascend.attention would compute this layer wrongly); serve this model "
                         f"without the ascend_graph backend")
        self.layer, self.feature = layer, feature


def backend_path(backend: Any) -> str:
    """`module.QualName` of a layer's attention backend class."""
    cls = backend if isinstance(backend, type) else type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def backend_refusal(layer: Any, supported: dict[str, str], what: str) -> str | None:
    """Why `layer`'s attention backend is none of `supported` (class path -> name), named as `what`
    (an attention or MLA backend) with its path and `get_name()`; None where it is one of them."""
    backend = getattr(layer, "attn_backend", None)
    path = backend_path(backend) if backend is not None else "none"
    if path in supported:
        return None
    label = backend.get_name() if hasattr(backend, "get_name") else "?"
    return f"{what} {path} (get_name() {label!r}); supported: " + ", ".join(supported.values())


def refusal(name: str, layer: Any) -> str | None:
    """Why the rewrite cannot serve vLLM attention layer `layer` (named `name`), or None if it can."""
    unsupported = backend_refusal(layer, SUPPORTED_BACKENDS, "attention backend")
    if unsupported:
        return unsupported
    impl = layer.impl
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi (impl.alibi_slopes)"
    kind = getattr(impl, "attn_type", DECODER)
    kind = getattr(kind, "value", kind)  # vLLM's AttentionType is a str enum
    if kind != DECODER:
        return f"attention type {kind!r} (only decoder self-attention)"
    try:
        layer_features(name, layer)
    except UnsupportedAttention as err:
        return err.feature
    for owner in (layer, impl):
        dtype = getattr(owner, "kv_cache_dtype", "auto")
        if dtype not in UNQUANTIZED_CACHE_DTYPES:
            return f"quantized KV cache (kv_cache_dtype={dtype!r})"
    return None


def layer_features(name: str, layer: Any) -> AttentionFeatures:
    """The attention features of vLLM layer `layer` as `ascend.attention` takes them; raises
    `UnsupportedAttention` for a window or sinks the rewrite cannot pass on.

    - window: FlashAttention's impl keeps `(left, right)`, `(W - 1, 0)` for a decoder layer built
      with `sliding_window=W` (`flash_attn.py` `FlashAttentionImpl.__init__`), `(-1, -1)` for none:
      its kernel attends keys in `[p - left, p + right]`, so `left + 1` keys, the query's own
      included, which is our `W` (`ops/features.py`). vLLM-Ascend's impl keeps the `W` itself
      (`AscendAttentionBackendImpl.sliding_window`, None for none); vLLM's `Attention` keeps it as
      `layer.sliding_window`, which must agree.
    - soft-cap: FlashAttention's `impl.logits_soft_cap` (0 for none). vLLM-Ascend's impl keeps none
      (nor do its kernels apply one), so a soft-capped model there is served as vLLM-Ascend serves it.
    - sinks: `impl.sinks`, one logit per query head (`layer.has_sink` says the layer was built with them).
    """
    impl = layer.impl
    window = _window(name, impl)
    stated = getattr(layer, "sliding_window", None)
    if stated is not None and stated != window:
        raise UnsupportedAttention(name, f"sliding window layer.sliding_window={stated!r} that the impl does not "
                                         f"apply as such (impl.sliding_window={getattr(impl, 'sliding_window', None)!r})")
    cap = getattr(impl, "logits_soft_cap", None) or None  # FlashAttention keeps 0 for "none"
    sinks = getattr(impl, "sinks", None)
    if sinks is None and getattr(layer, "has_sink", False):
        raise UnsupportedAttention(name, "attention sinks the impl does not hold (layer.has_sink, impl.sinks None)")
    try:
        return AttentionFeatures(window, None if cap is None else float(cap), sinks is not None)
    except ValueError as err:
        raise UnsupportedAttention(name, f"attention features {err}") from None


def _window(name: str, impl: Any) -> int | None:
    """The impl's causal window as our `W` (keys attended, the query's own included), or None."""
    window = getattr(impl, "sliding_window", None)
    if window is None or window == (-1, -1):
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        return window  # vLLM-Ascend's impl: the W the layer was built with
    if isinstance(window, (tuple, list)) and len(window) == 2 and window[1] == 0 and window[0] >= 0:
        return int(window[0]) + 1  # FlashAttention's (W - 1, 0)
    raise UnsupportedAttention(name, f"sliding window impl.sliding_window={window!r} (only causal windows "
                                     f"(left, 0) are computed: a window reaching right of the query is not)")


def refuse_unsupported(layers: dict[str, Any]) -> None:
    """Raise `UnsupportedAttention` for the first of `layers` (name -> vLLM layer) the rewrite cannot serve."""
    for name, layer in layers.items():
        reason = refusal(name, layer)
        if reason is not None:
            raise UnsupportedAttention(name, reason)


def refuse_metadata(name: str, metadata: Any) -> None:
    """The per-step metadata's features: non-causal attention and fields the rewrite does not find."""
    semantics = step_semantics(metadata)
    if semantics is not None:
        raise UnsupportedAttention(name, semantics)
    missing = [f for f in ("seq_lens", "query_start_loc") if not hasattr(metadata, f)]
    if not (hasattr(metadata, "block_table") or hasattr(metadata, "block_tables")):
        missing.append("block_table")
    if missing:
        raise UnsupportedAttention(name, f"attention metadata {type(metadata).__qualname__} without {missing}")


def refuse_cache_dtype(name: str, cache: torch.Tensor) -> None:
    """A KV cache tensor of a quantized element type (fp8 / int8 / uint8 storage)."""
    if cache.dtype not in CACHE_TENSOR_DTYPES:
        raise UnsupportedAttention(name, f"quantized KV cache (cache dtype {cache.dtype})")
