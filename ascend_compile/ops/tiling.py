"""Host-side tiling and workspace sizes of the attention kernels.

Both reference kernels are split-K: a sequence's KV range is cut into `splits` chunks, each chunk's
partial output and log-sum-exp go to the workspace, and a reduce combines them. The number of splits
is decided on the host from the sequence's length, as Ascend's tiling does, so the workspace a call
needs depends on the lengths it is given.

Workspace formula (bytes, float32 partials), for one query token attending `L` keys:

    per_token(L) = splits(L) * H * (D + 1) * 4    if splits(L) > 1 else 0

and a call needs the sum of `per_token(kv_len)` over its query tokens (one token per sequence for PA).
The need of a call is a sum of independent per-token terms, so the worst case for a graph of `T`
query tokens is `T * max_L per_token(L)`; that is what `max_workspace` computes, by a vectorised scan.

The split rules below are a **model**, not Ascend's tiling: nobody measured a device to write them.
They are built to have the one property of Ascend's PA workspace that DESIGN.md §7 case 1 is about:
`splits(L)` is not monotonic. PA switches to long-sequence tiling (larger chunks, fewer splits) above
`PA_LONG_SEQ`, so its need peaks at an interior length (3841 here) and falls after it. The seed's
peak was elsewhere (vLLM-Ascend pinned 6144); the sizes and the arg-max this module gives are the
model's, and only the planning around them (exact maximum over every length) carries over.

With a device, size workspaces from real queries instead: ask the kernel's workspace query for one
query token at every length `L` in `[1, max_model_len]` (torch_npu's
`_npu_paged_attention_get_workspace`), divide each answer by `split_record_nbytes(shape)` to get
a split count, and register that table as the kernel's rule, so `max_workspace` scans the measured
need::

    table = torch.tensor([0] + [measured_nbytes(L) // split_record_nbytes(shape) for L in range(1, max_len + 1)])
    register_tiling(PA, lambda kv_lens: table[kv_lens.clamp(max=max_len)])

(`runtime="npu"` does the probing itself at compile time, `passes/probe.py`; this is for the model
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
from typing import Callable, Sequence

import torch

PA = "paged_attention"
FIA = "fused_infer_attention"
MLA = "mla_fused_infer_attention"

PA_CHUNK_TOKENS = 256
PA_LONG_SEQ = 4096
PA_LONG_CHUNK_TOKENS = 2048
PA_MAX_SPLITS = 16

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


def pa_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """Number of KV splits PA uses for each length (0 for an empty sequence)."""
    chunk = torch.where(kv_lens > PA_LONG_SEQ, PA_LONG_CHUNK_TOKENS, PA_CHUNK_TOKENS)
    return _ceil_div(kv_lens, chunk).clamp(max=PA_MAX_SPLITS)


def fia_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """Number of KV splits FIA uses for each length (0 for an empty sequence)."""
    return _ceil_div(kv_lens, FIA_CHUNK_TOKENS).clamp(max=FIA_MAX_SPLITS)


def mla_splits(kv_lens: torch.Tensor) -> torch.Tensor:
    """Number of KV splits the MLA kernel uses for each length (0 for an empty sequence)."""
    chunk = torch.where(kv_lens > MLA_LONG_SEQ, MLA_LONG_CHUNK_TOKENS, MLA_CHUNK_TOKENS)
    return _ceil_div(kv_lens, chunk).clamp(max=MLA_MAX_SPLITS)


SplitsFn = Callable[[torch.Tensor], torch.Tensor]
_SPLITS: dict[str, SplitsFn] = {PA: pa_splits, FIA: fia_splits, MLA: mla_splits}


def register_tiling(kernel: str, splits: SplitsFn) -> None:
    """Declare the split rule of a kernel so its workspace can be sized and scanned.

    `splits` maps a tensor of KV lengths to the number of split-K chunks for each; the workspace
    then follows the formula of this module. A measured per-length table plugs in as a lookup
    (see the module docstring): `register_tiling(PA, lambda kv_lens: table[kv_lens])`.
    """
    _SPLITS[kernel] = splits


def splits_for(kernel: str, kv_lens: torch.Tensor) -> torch.Tensor:
    """Split counts of `kernel` for each KV length."""
    try:
        fn = _SPLITS[kernel]
    except KeyError:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; known: {sorted(_SPLITS)}") from None
    return fn(kv_lens.to(torch.int64))


def split_record_nbytes(shape: AttentionShape) -> int:
    """Bytes one split of one query token keeps in the workspace: float32 partials and LSE per head."""
    return shape.num_heads * (shape.head_dim + 1) * 4


def per_token_nbytes(kernel: str, shape: AttentionShape, kv_lens: torch.Tensor) -> torch.Tensor:
    """Workspace bytes one query token of each KV length needs (vectorised over `kv_lens`)."""
    splits = splits_for(kernel, kv_lens)
    return torch.where(splits > 1, splits * split_record_nbytes(shape), torch.zeros_like(splits))


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
    per = per_token_nbytes(kernel, shape, kv)
    if query_lens is not None:
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"query_lens: expected one entry per sequence ({len(seq_lens)}), got {len(query_lens)}"
            )
        per = per * torch.tensor(list(query_lens), dtype=torch.int64)
    return int(per.sum())


@dataclasses.dataclass(frozen=True)
class WorkspaceMax:
    """The worst-case workspace of one kernel over a range of lengths."""

    nbytes: int
    per_token_nbytes: int
    argmax_len: int


def max_workspace(
    kernel: str, shape: AttentionShape, num_tokens: int, max_model_len: int
) -> WorkspaceMax:
    """Exact maximum workspace for `num_tokens` query tokens over every length in [1, max_model_len]."""
    peak, argmax = _peak_per_token(kernel, _SPLITS.get(kernel), shape, max_model_len)
    return WorkspaceMax(nbytes=num_tokens * peak, per_token_nbytes=peak, argmax_len=argmax)


@functools.lru_cache(maxsize=256)
def _peak_per_token(kernel: str, splits: SplitsFn | None, shape: AttentionShape, max_model_len: int) -> tuple[int, int]:
    """(peak per-token bytes, first length reaching it): one vectorised scan per kernel rule and shape."""
    lens = torch.arange(1, max_model_len + 1, dtype=torch.int64)
    per = per_token_nbytes(kernel, shape, lens)
    idx = int(torch.argmax(per))  # the first maximal index
    return int(per[idx]), idx + 1
