"""Attention features beyond plain causal attention: a left window, per-head sinks, a logit soft-cap.

Semantics (DESIGN.md §3, the reference kernels in `reference.py` implement them exactly):

- **window** `W` (None: unbounded): a query token at position `p` attends the keys at positions in
  `(p - W, p]`, that is itself and the `W - 1` before it. transformers' sliding-window mask
  (`kv_idx > q_idx - sliding_window`) and vLLM's FlashAttention (`window_size=(sliding_window - 1, 0)`)
  mean the same `W`.
- **soft_cap** `c` (None: off): every scaled logit `s` becomes `c * tanh(s / c)` before the softmax
  (Gemma 2's `attn_logit_softcapping`, vLLM's `logits_soft_cap`).
- **sinks** (None: off): a float32 `[H]` tensor, one learned logit per query head that joins the
  softmax denominator and attends no value (gpt-oss): `out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h})`.

A window also bounds what a kernel reads: a sequence whose last `q` query tokens end at KV length
`L` reads only its last `min(L, W + q - 1)` keys (its *span*), so blocks before the span may be
freed or reused by the runtime (vLLM's hybrid KV-cache manager does), and the kernels' tiling and
workspace follow the span, not `L`.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
    """The features of one attention call, static for a layer."""

    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window < 1):
            raise ValueError(f"window: expected a positive int (keys attended, the query's own included) or None, "
                             f"got {self.window!r}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap: expected a positive float or None, got {self.soft_cap!r}")

    @property
    def plain(self) -> bool:
        """Plain causal attention: no feature set."""
        return self.window is None and self.soft_cap is None and not self.sinks

    def names(self) -> list[str]:
        """The features set, as their argument names (for refusals and the plan)."""
        return [name for name, on in (("window", self.window is not None), ("soft_cap", self.soft_cap is not None),
                                      ("sinks", self.sinks)) if on]

    def span(self, kv_len: int, query_len: int) -> int:
        """Keys a sequence of `query_len` query tokens ending at `kv_len` reads."""
        if self.window is None:
            return kv_len
        return min(kv_len, self.window + max(query_len, 1) - 1)

    def longest_span(self, max_model_len: int, max_query_len: int) -> int:
        """The longest span any sequence of at most `max_query_len` query tokens reads."""
        return self.span(max_model_len, max_query_len)

    def describe(self) -> dict[str, Any]:
        return {"window": self.window, "soft_cap": self.soft_cap, "sinks": self.sinks}


PLAIN = AttentionFeatures()
