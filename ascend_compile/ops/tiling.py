"""Host-side tiling and workspace sizes of the attention kernels.

Both reference kernels are split-K: a sequence's KV range is cut into `splits` chunks, each chunk's
partial output and log-sum-exp go to the workspace, and a reduce combines them. The number of splits
is decided on the host from the call's lengths, as Ascend's tiling does, so the workspace a call
needs depends on the lengths it is given.

Workspace formula (bytes, float32 partials), for one query token attending `L` keys in tiling mode `m`:

    w_m(L) = splits_m(L) * H * (D + 1) * 4    if splits_m(L) > 1 else 0

and a call needs the sum of `w_m(kv_len)` over its query tokens (one token per sequence for PA), all
in the call's one mode. A kernel's rule (`Tiling`) has one mode, or two: the **long** one when every
nonempty sequence of the call is longer than `long_above`, the **short** one otherwise. So the need
of a call is not a function of each length alone: one short sequence puts every sequence of the
call in short tiling.

The rules below are a **model**, not Ascend's tiling: nobody measured a device to write them. They
are built to have the two properties of Ascend's PA workspace that matter to planning:

- for a batch of one length, `splits(L)` is not monotonic (DESIGN.md §7 case 1): PA switches to
  long-sequence tiling (larger chunks, fewer splits) above `PA_LONG_SEQ`, so the need of a uniform
  batch peaks at an interior length (3841 here) and falls after it;
- the need depends on the mix of lengths: a long sequence batched with one of at most `PA_LONG_SEQ`
  is tiled short, taking up to `PA_MAX_SHORT_SPLITS` splits, more than any length takes alone, so a
  mixed batch needs more than every uniform batch. vLLM-Ascend found PA's need not monotonic and,
  at HEAD, asks `_npu_paged_attention_get_workspace` again with the real lengths at every update
  (`vllm_ascend/attention/utils.py`); this is the model's version of that dependence.

The seed's peak was elsewhere (vLLM-Ascend pinned 6144); the sizes and arg-maxes this module gives
are the model's, and only the planning around them (the exact maximum over every batch) carries
over. `max_workspace` computes that maximum in closed form (proof in its docstring).

With a device, size workspaces from real queries instead: ask the kernel's workspace query for one
query token at every length `L` in `[1, max_model_len]` (torch_npu's
`_npu_paged_attention_get_workspace`), divide each answer by `split_record_nbytes(shape)` to get
a split count, and register that table as the kernel's rule, so `max_workspace` scans the measured
need::

    table = torch.tensor([0] + [measured_nbytes(L) // split_record_nbytes(shape) for L in range(1, max_len + 1)])
    register_tiling(PA, lambda kv_lens: table[kv_lens.clamp(max=max_len)])

(a one-mode table: it sees no mix dependence, which only batches of mixed lengths would measure.
`runtime="npu"` does the probing itself at compile time, `passes/probe.py`; this is for the model
and for tools that plan workspaces without a device at hand.)

**MLA** (`ops/mla.py`) is split-K attention too, over one latent KV head: its partials have the
latent's dim (`head_dim` = kv_lora_rank; the keys' rope part, `rope_dim`, adds to the scores, not
to the partials), so the formula above holds as is. Its rule models a decode kernel like PA's: short
chunks below `MLA_LONG_SEQ`, long ones above, so its need too peaks at an interior length
(897, while max_model_len is below 7681).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import torch

PA = "paged_attention"
FIA = "fused_infer_attention"
MLA = "mla_fused_infer_attention"

PA_CHUNK_TOKENS = 256
PA_LONG_SEQ = 4096
PA_LONG_CHUNK_TOKENS = 2048
PA_MAX_SPLITS = 16
#: The most splits short tiling gives a sequence: only reached by one longer than `PA_LONG_SEQ`,
#: which is tiled short only when batched with a shorter one.
PA_MAX_SHORT_SPLITS = 32

FIA_CHUNK_TOKENS = 1024
FIA_MAX_SPLITS = 8

MLA_CHUNK_TOKENS = 128
MLA_LONG_SEQ = 1024
MLA_LONG_CHUNK_TOKENS = 512
MLA_MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The static shape of an attention call that its tiling and workspace depend on.

    `head_dim` is the dim of the values (and partial outputs); `rope_dim` that of the keys' rope
    part, which only MLA has (`ops/mla.py`: its keys are the latent plus a rope part, its values
    the latent alone), 0 elsewhere."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rope_dim: int = 0

    @property
    def latent(self) -> bool:
        """An MLA layer's shape: its keys have a rope part beside the latent they share with the values."""
        return self.rope_dim > 0

    @classmethod
    def of(cls, query: torch.Tensor, key_cache: torch.Tensor) -> "AttentionShape":
        """The shape of a call from its query `[T, H, D]` and key cache `[NB, BS, KVH, D]`."""
        return cls(
            num_heads=int(query.shape[1]),
            num_kv_heads=int(key_cache.shape[2]),
            head_dim=int(query.shape[2]),
            block_size=int(key_cache.shape[1]),
        )

    @classmethod
    def of_mla(cls, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor) -> "AttentionShape":
        """The shape of an MLA call: `q_nope [T, H, kv_lora_rank]`, `q_pe [T, H, rope_dim]`, one latent
        KV head in `kv_c_cache [NB, BS, kv_lora_rank]`."""
        return cls(num_heads=int(q_nope.shape[1]), num_kv_heads=1, head_dim=int(q_nope.shape[2]),
                   block_size=int(kv_c_cache.shape[1]), rope_dim=int(q_pe.shape[2]))


def _ceil_div(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


SplitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A kernel's split rule: the split count of a sequence from its own KV length, by the `short`
    rule, or, when `long` is given and every nonempty sequence of the call is longer than
    `long_above`, by the `long` rule. A two-mode rule is for decode kernels (one query token per
    sequence), which `max_workspace` assumes of it."""

    short: SplitsFn
    long: Optional[SplitsFn] = None
    long_above: int = 0

    def is_long(self, kv_lens: torch.Tensor) -> bool:
        """Whether a call with these KV lengths is tiled long."""
        nonempty = kv_lens[kv_lens > 0]
        return self.long is not None and bool(nonempty.numel()) and int(nonempty.min()) > self.long_above

    def splits(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Split counts of each sequence of one call (0 for an empty sequence)."""
        return (self.long if self.is_long(kv_lens) else self.short)(kv_lens)

    def uniform_splits(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Split counts at each length of `kv_lens` for a call whose sequences all have that length."""
        if self.long is None:
            return self.short(kv_lens)
        return torch.where(kv_lens > self.long_above, self.long(kv_lens), self.short(kv_lens))


def pa_short_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """PA's short tiling: chunks of `PA_CHUNK_TOKENS`, at most `PA_MAX_SHORT_SPLITS`."""
    return _ceil_div(kv_lens, PA_CHUNK_TOKENS).clamp(max=PA_MAX_SHORT_SPLITS)


def pa_long_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """PA's long-sequence tiling: chunks of `PA_LONG_CHUNK_TOKENS`, at most `PA_MAX_SPLITS`."""
    return _ceil_div(kv_lens, PA_LONG_CHUNK_TOKENS).clamp(max=PA_MAX_SPLITS)


def fia_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """Number of KV splits FIA uses for each length (0 for an empty sequence)."""
    return _ceil_div(kv_lens, FIA_CHUNK_TOKENS).clamp(max=FIA_MAX_SPLITS)


def mla_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """Number of KV splits the MLA kernel uses for each length (0 for an empty sequence)."""
    chunk = torch.where(kv_lens > MLA_LONG_SEQ, MLA_LONG_CHUNK_TOKENS, MLA_CHUNK_TOKENS)
    return _ceil_div(kv_lens, chunk).clamp(max=MLA_MAX_SPLITS)


PA_TILING = Tiling(pa_short_splits, pa_long_splits, PA_LONG_SEQ)
_TILINGS: dict[str, Tiling] = {PA: PA_TILING, FIA: Tiling(fia_splits), MLA: Tiling(mla_splits)}


def register_tiling(kernel: str, rule: Union[SplitsFn, Tiling]) -> None:
    """Declare the split rule of a kernel so its workspace can be sized and scanned.

    `rule` is a `Tiling`, or a function mapping a tensor of KV lengths to the number of split-K
    chunks for each (one mode); the workspace then follows the formula of this module. A measured
    per-length table plugs in as a lookup (see the module docstring):
    `register_tiling(PA, lambda kv_lens: table[kv_lens])`.
    """
    _TILINGS[kernel] = rule if isinstance(rule, Tiling) else Tiling(rule)


def tiling_of(kernel: str) -> Tiling:
    """The split rule of `kernel`."""
    try:
        return _TILINGS[kernel]
    except KeyError:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; known: {sorted(_TILINGS)}") from None


def splits_for(kernel: str, kv_lens: torch.Tensor) -> torch.Tensor:
    """Split counts of `kernel` for each sequence of one call with these KV lengths."""
    return tiling_of(kernel).splits(kv_lens.to(torch.int64))


def split_record_nbytes(shape: AttentionShape) -> int:
    """Bytes one split of one query token keeps in the workspace: float32 partials and LSE per head."""
    return shape.num_heads * (shape.head_dim + 1) * 4


def _nbytes_of(splits: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """Workspace bytes of one query token of a sequence with `splits` splits (vectorised)."""
    return torch.where(splits > 1, splits * split_record_nbytes(shape), torch.zeros_like(splits))


def per_token_nbytes(kernel: str, shape: AttentionShape, kv_lens: torch.Tensor) -> torch.Tensor:
    """Workspace bytes one query token of each KV length needs in a call whose sequences all have
    that length (vectorised over `kv_lens`)."""
    return _nbytes_of(tiling_of(kernel).uniform_splits(kv_lens.to(torch.int64)), shape)


def workspace_nbytes(
    kernel: str,
    shape: AttentionShape,
    seq_lens: Sequence[int],
    query_lens: Sequence[int] | None = None,
) -> int:
    """Exact workspace bytes a call of `kernel` needs for these host-side lengths.

    `seq_lens` are the KV lengths per sequence; `query_lens` the query tokens per sequence
    (1 each when omitted: decode).
    """
    kv = torch.tensor(list(seq_lens), dtype=torch.int64)
    per = _nbytes_of(splits_for(kernel, kv), shape)
    if query_lens is not None:
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"query_lens: expected one entry per sequence ({len(seq_lens)}), got {len(query_lens)}"
            )
        per = per * torch.tensor(list(query_lens), dtype=torch.int64)
    return int(per.sum())


@dataclasses.dataclass(frozen=True)
class WorkspaceMax:
    """The worst-case workspace of one kernel over every call of a graph: its bytes, the KV lengths
    of a call that needs them (`argmax_batch`, one per query token, longest first), and the length
    in it whose tokens need the most (`argmax_len`)."""

    nbytes: int
    argmax_len: int
    argmax_batch: tuple[int, ...]


def max_workspace(kernel: str, shape: AttentionShape, num_tokens: int, max_model_len: int) -> WorkspaceMax:
    """Exact maximum workspace of `kernel` over every call of a graph of `num_tokens` query tokens
    whose KV lengths lie in [0, max_model_len] (0: an empty, padding sequence), mixed or not.

    Proof. Write `w_m(L)` for the bytes of one token of KV length `L` in mode `m` (`w_m(0) = 0`),
    `M = max_model_len`, `T = num_tokens`, `Λ = long_above`. A call is tiled in one mode, so its need
    is `Σ_tokens w_m(L)`. One-mode rule: each term is at most `A = max_{1≤L≤M} w(L)`, so the need is
    at most `T·A`, met by every token at the first arg-max. Two-mode rule (decode: one token per
    sequence, `T` sequences):
    - a long call has every nonempty length in `(Λ, M]`: each term is at most `A_l = max_{Λ<L≤M}
      w_long(L)`, so its need is at most `T·A_l` (no long call has a nonempty sequence if `Λ ≥ M`);
    - a short call has a sequence `j` with `1 ≤ L_j ≤ min(Λ, M)`: its term is at most `B_s =
      max_{1≤L≤min(Λ,M)} w_short(L)`, every other at most `A_s = max_{0≤L≤M} w_short(L)`, so its need
      is at most `B_s + (T-1)·A_s`, met by `L_j` at the arg-max of `B_s` and the others at that of
      `A_s` (which is a short call: `L_j ≤ Λ`).
    Every call is long or short and each bound is met by a call of its kind, so the maximum is the
    larger of `T·A_l` and `B_s + (T-1)·A_s`. Each of `A`, `A_l`, `A_s`, `B_s` is one vectorised scan
    over `[1, M]`, cached per rule, shape and `M`. ∎
    """
    return _maximum(tiling_of(kernel), shape, num_tokens, max_model_len)


@functools.lru_cache(maxsize=256)
def _scan(rule: Tiling, shape: AttentionShape, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of one token at each length 1..max_model_len, in short and in long tiling."""
    lens = torch.arange(1, max_model_len + 1, dtype=torch.int64)
    short = _nbytes_of(rule.short(lens), shape)
    long = _nbytes_of(rule.long(lens), shape) if rule.long is not None else torch.zeros_like(short)
    return short, long


def _peak(per: torch.Tensor, first: int, last: int) -> tuple[int, int]:
    """(largest bytes, first length with them) over lengths first..last (1-based) of a scan; (0, 0)
    for an empty range."""
    if last < first:
        return 0, 0
    part = per[first - 1 : last]
    index = int(torch.argmax(part))  # the first maximal index
    return int(part[index]), first + index


def _maximum(rule: Tiling, shape: AttentionShape, tokens: int, max_model_len: int) -> WorkspaceMax:
    if tokens < 1:
        return WorkspaceMax(0, 0, ())
    short, long = _scan(rule, shape, max_model_len)
    if rule.long is None:
        peak, length = _peak(short, 1, max_model_len)
        return WorkspaceMax(tokens * peak, length, (length,) * tokens)
    long_peak, long_len = _peak(long, rule.long_above + 1, max_model_len)
    one_short, one_short_len = _peak(short, 1, min(rule.long_above, max_model_len))
    any_short, any_short_len = _peak(short, 1, max_model_len)
    mixed = one_short + (tokens - 1) * any_short
    if tokens * long_peak > mixed:
        return WorkspaceMax(tokens * long_peak, long_len, (long_len,) * tokens)
    batch = tuple(sorted((any_short_len,) * (tokens - 1) + (one_short_len,), reverse=True))
    return WorkspaceMax(mixed, any_short_len if tokens > 1 else one_short_len, batch)


def max_uniform_workspace(kernel: str, shape: AttentionShape, num_tokens: int, max_model_len: int) -> WorkspaceMax:
    """The largest workspace of `kernel` over calls of `num_tokens` query tokens that all have one KV
    length in [1, max_model_len]: what asking a workspace query at each length, one length per call,
    finds. Below `max_workspace` for a kernel whose need depends on the mix of lengths."""
    rule = tiling_of(kernel)
    short, long = _scan(rule, shape, max_model_len)
    per = short.clone()
    if rule.long is not None:
        per[rule.long_above :] = long[rule.long_above :]  # lengths above long_above, alone, are tiled long
    peak, length = _peak(per, 1, max_model_len)
    return WorkspaceMax(num_tokens * peak, length, (length,) * num_tokens)
