"""One step's inputs: host conversions (once per input), bucket choice, the step's plan, and
padding by role.

A step is read once (`read_step`: the host copies of its lengths, its sizes) and, once its graph
is chosen, planned once (`plan_step`: every padded host list its kernels take), as FlashInfer splits
`plan()` from `run()`: the update table and eager runs only consume the plan.

Padding rules live here (and, for what padding sequences get in kernels' lists, in
`passes/padding.py`): `seq_lens` 0, `slot_mapping` -1, `query_start_loc`
extended so the padded tokens belong to padded (empty) sequences, block tables and batch data 0.
The host lengths the kernels take give a padding sequence a KV length of its query length, at least
1 (row 0 of the padded block table, block 0, is a valid block). torch_npu 2.14 documents any
non-negative `actual_seq_lengths_kv` up to KV_S (`_op_plugin_docs.py`, npu_fused_infer_attention_score)
and vLLM-Ascend sends 0 for padded decode requests (`model_runner_v1.py`, `seq_lens[num_reqs:].fill_(0)`),
but no document says what a batch entry of length 0 outputs (only the kernels' zero-init path does,
and FIA's tiling checks a prefix of the list for it); a length of at least the query's keeps every
causal row attending a key, so no path of the kernel outside its documented contract is taken.

Mixed steps pack their padded tokens into dummy sequences of at most 128 tokens, each its query
length as KV length, and a kernel's batch is its lists' length (`passes/padding.py` says why);
decode steps give each padded token a padding sequence of its own. A bucket graph is captured for
`bucket` tokens and as many sequences (or, where dynamo traced a static sequence count, for exactly
that many).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from ..ops.tiling import PA
from ..passes.kernel_call import Conversion, HostSource, kernel_calls
from ..passes.padding import PADDING_CHUNK, dummy_query_lens
from ..passes.probe import VLLM_ASCEND_PINNED_LEN
from ..passes.roles import PAD_VALUE, GraphSignature, InputSpec, Role
from ..passes.size_symbols import evaluate


@dataclasses.dataclass(slots=True)
class Step:
    """What the runner knows about one call before it picks a graph (not frozen: a frozen dataclass's
    `__init__` sets each field through `object.__setattr__`, a cost on every step's path)."""

    args: Sequence[Any]
    symbols: dict
    tokens: int
    seqs: int
    decode: bool
    seq_lens: dict[str, list[int]]  # host copies, per seq_lens input
    query_start_loc: dict[str, list[int]]  # host copies, per query_start_loc input
    reads: int = 0  # length inputs read from their tensors (`tolist()`): not given as host copies

    @property
    def copies(self) -> int:
        """Length inputs taken from a provider's host copies (no read of their tensors)."""
        return len(self.seq_lens) + len(self.query_start_loc) - self.reads


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The padded size of a captured graph: its token and sequence counts, and the most query tokens
    a dummy sequence of its mixed steps holds (`passes/padding.py`)."""

    tokens: int
    seqs: int
    dummy_limit: int = PADDING_CHUNK


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step planned for one graph: the step, and each host list its kernels take, padded."""

    step: Step
    host: dict[HostSource, list[int]]


def plan_step(step: Step, sources: Sequence[HostSource], geometry: Geometry) -> StepPlan:
    """The padded host list of every source a graph's kernels read, computed once for the step."""
    return StepPlan(step, {src: host_value(step, src, geometry) for src in sources})


def read_step(signature: GraphSignature, args: Sequence[Any], max_model_len: int, host_lengths: bool = True,
              host_copies: Mapping[str, list[int]] | None = None) -> Step:
    """Host conversions of one step (one `tolist()` per length input) and its checks.

    `host_copies` (a provider's, `Provider.host`) are taken for the inputs they name instead of
    their tensors' data: no device-to-host read for those (a copy of another length than its
    tensor is a provider's bug, refused naming the input). Without `host_lengths` (a target whose
    kernels read lengths on the device) nothing is converted, so the host never waits for the
    device: decode steps are those with as many tokens as sequences, and the checks
    (`max_model_len`, at least one query token per sequence) run on the device."""
    symbols, tokens, seqs = signature.step_sizes(args)
    if not host_lengths:
        _check_on_device(signature, args, max_model_len)
        return Step(args, symbols, tokens, seqs, tokens == seqs, {}, {})
    seq_lens, starts, reads = {}, {}, 0
    for spec in signature.by_role(Role.SEQ_LENS):
        lens, read = _host_list(spec, args, host_copies)
        reads += read
        longest = max(lens, default=0)
        if longest > max_model_len:
            raise ValueError(
                f"seq_lens: a sequence of length {longest} exceeds max_model_len={max_model_len}, the longest "
                f"the graphs' workspaces were sized for; compile with a larger max_model_len"
            )
        seq_lens[spec.name] = lens
    decode = True
    for spec in signature.by_role(Role.QUERY_START_LOC):
        loc, read = _host_list(spec, args, host_copies)
        reads += read
        starts[spec.name] = loc
        decode = decode and loc == _decode_start_loc(len(loc))
    return Step(args, symbols, tokens, seqs, decode, seq_lens, starts, reads)


def _host_list(spec: InputSpec, args: Sequence[Any], host_copies: Mapping[str, list[int]] | None
               ) -> tuple[list[int], int]:
    """A length input's values, and 1 where they were read from its tensor (0: its provider's host copy)."""
    copy = host_copies.get(spec.name) if host_copies else None
    if copy is None:
        return args[spec.index].tolist(), 1
    if len(copy) != args[spec.index].shape[0]:  # its length is the tensor's shape: checked without a read
        raise ValueError(f"{spec.name}: its host copy has {len(copy)} entries and the tensor "
                         f"{args[spec.index].shape[0]}: a provider's host copy stands for the tensor's values")
    return copy, 0


@functools.lru_cache(maxsize=None)
def _decode_start_loc(length: int) -> list[int]:
    """`query_start_loc` of a decode step (one token per sequence), compared at C speed; not to be mutated."""
    return list(range(length))


def _check_on_device(signature: GraphSignature, args: Sequence[Any], max_model_len: int) -> None:
    """The step's length checks as asynchronous device asserts (no host sync)."""
    for spec in signature.by_role(Role.SEQ_LENS):
        lens = args[spec.index]
        if lens.numel():
            torch._assert_async(lens.max() <= max_model_len,
                                f"seq_lens: a sequence exceeds max_model_len={max_model_len}, the longest the "
                                f"graphs' workspaces were sized for; compile with a larger max_model_len")
    for spec in signature.by_role(Role.QUERY_START_LOC):
        loc = args[spec.index]
        if loc.numel() > 1:
            torch._assert_async((loc[1:] - loc[:-1]).min() >= 1,
                                "query_start_loc: every sequence needs at least one query token")


def choose_bucket(buckets: Sequence[int], tokens: int, seqs: int = 0) -> int | None:
    """The smallest bucket holding `tokens` tokens and `seqs` sequences, or None when no bucket fits.

    A bucket's graph has as many sequences as tokens, and padded tokens belong to padding sequences
    of their own: a step with sequences of no query tokens (as many sequences as tokens, or more)
    needs a bucket with room for its sequences and, where it pads tokens, one padding sequence."""
    i = bisect.bisect_left(buckets, tokens)
    while i < len(buckets) and (buckets[i] < seqs or (buckets[i] == seqs and buckets[i] > tokens)):
        i += 1
    return None if i == len(buckets) else buckets[i]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range a tensor's elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    low = t.data_ptr() - sum((n - 1) * -s for n, s in zip(t.shape, t.stride()) if s < 0) * t.element_size()
    return low, low + (span + 1) * t.element_size()


def overlapping_inputs(signature: GraphSignature, alias_groups: Sequence[frozenset[int]], written: set[int],
                       copied: set[int], args: Sequence[Any]) -> list[str]:
    """Names of inputs sharing memory with an input the graph writes, in this step, where one of the
    two is staged in a static buffer: the graph would read or write a copy, so such a step runs
    eagerly instead. Inputs used in place (e.g. KV caches that are views of one flat cache) see each
    other's writes as in eager."""
    for group in alias_groups:
        if not group & written or not group & copied:
            continue
        extents = {i: _extent(args[i]) for i in group}
        for i in group & written:
            low, high = extents[i]
            others = [j for j in group if j != i and (i in copied or j in copied)
                      and extents[j][0] < high and low < extents[j][1]]
            if others:
                return [signature.inputs[k].name for k in [i, *others]]
    return []


def padded_start_loc(loc: Sequence[int], tokens: int, padded_tokens: int, padded_seqs: int) -> list[int]:
    """`query_start_loc` for `padded_seqs` sequences: padded tokens go one each to padded
    sequences, the last padded sequence taking any rest."""
    extra = [min(tokens + j, padded_tokens) for j in range(1, padded_seqs + 2 - len(loc))]
    if extra:
        extra[-1] = padded_tokens
    return list(loc) + extra


#: The KV length of every sequence when a decode graph with PA is captured: vLLM-Ascend captures PA
#: at SEQ_LEN_WITH_MAX_PA_WORKSPACE (`vllm_ascend/worker/model_runner_v1.py`, `_dummy_run`), never at 0;
#: the NPU target asks PA's workspace there too (`passes/probe.py`).
PA_CAPTURE_SEQ_LEN = VLLM_ASCEND_PINNED_LEN


def capture_seq_len(gm: fx.GraphModule, key: Any, signature: GraphSignature, buffers: Mapping[int, torch.Tensor],
                    max_model_len: int | None) -> int | None:
    """The KV length a decode graph with PA is captured at, within what its block table holds
    (never 0: a kernel's zero-length fast path would record another task than its updates
    issue); None (padding lengths) for other graphs. `key` is the graph's `GraphKey`."""
    pa = [c for c in kernel_calls(gm) if c.meta.kernel == PA]
    if not key.decode or not pa:
        return None
    widths = [buffers[s.index].shape[-1] for s in signature.by_role(Role.BLOCK_TABLE) if s.index in buffers]
    capacity = min(widths, default=PA_CAPTURE_SEQ_LEN) * pa[0].meta.shape.block_size
    return min(PA_CAPTURE_SEQ_LEN, capacity, max_model_len or PA_CAPTURE_SEQ_LEN)


def capture_plan(sources: Sequence[HostSource], geometry: Geometry, seq_len: int | None, packed: bool = False
                 ) -> StepPlan:
    """The plan a graph is captured with: no real tokens, and each `seq_lens` source holding
    `geometry.seqs` sequences of `seq_len` (None: all padding, each sequence as long as its query,
    `packed` into dummies as a mixed step's padding is: a graph serving mixed steps is captured with a
    mixed call, as FIA v2's MLA form needs, whose sparse mode follows the call's query lengths,
    `ops/npu/mla.py`)."""
    lens = [seq_len] * geometry.seqs if seq_len is not None else []
    names = {src.source for src in sources}
    step = Step((), {}, 0, 0, not packed, {name: list(lens) for name in names}, {name: [0] for name in names})
    return plan_step(step, sources, geometry)


def _dummies(step: Step, geometry: Geometry) -> tuple[int, ...]:
    """The query lengths of a mixed step's dummy sequences in a graph of this geometry."""
    loc = next(iter(step.query_start_loc.values()), [0])
    return dummy_query_lens(geometry.tokens - loc[-1], geometry.seqs - (len(loc) - 1), geometry.dummy_limit)


def _padding_kv_lens(step: Step, count: int, padded_tokens: int, padded_seqs: int) -> tuple[int, ...]:
    """KV lengths of the last `count` (padding) sequences: each its query length, at least 1."""
    loc = next(iter(step.query_start_loc.values()), None)
    if loc is None:
        return (1,) * count
    return _padding_query_lens(count, len(loc), loc[-1] if loc else 0, step.tokens, padded_tokens, padded_seqs)


@functools.lru_cache(maxsize=4096)
def _padding_query_lens(count: int, length: int, last: int, tokens: int, padded_tokens: int,
                        padded_seqs: int) -> tuple[int, ...]:
    """The query lengths (at least 1) of the last `count` sequences once a `query_start_loc` of
    `length` entries ending at `last` is padded: they depend on the sizes only, not on the step's
    real lengths, so each step shape computes them once."""
    ends = padded_start_loc([0] * (length - 1) + [last], tokens, padded_tokens, padded_seqs)
    return tuple(max(1, b - a) for a, b in zip(ends[-count - 1:], ends[-count:])) if count else ()


def host_value(step: Step, source: HostSource, geometry: Geometry) -> list[int]:
    """The padded host list a kernel argument takes in a graph of this geometry: for a mixed step,
    the real sequences then the dummies (each its query length as KV length); for a decode step, a
    padding sequence per padded token up to the graph's sequence count (PA's layout: a mixed step
    never runs on a graph with PA, `passes/pipeline.py: bucket_choices`)."""
    if not step.decode:
        dummies = _dummies(step, geometry)
        if source.conversion is Conversion.LIST:
            return [*step.seq_lens[source.source], *dummies]
        loc = step.query_start_loc[source.source]
        return list(loc[1:]) + list(itertools.accumulate(dummies, initial=loc[-1]))[1:]
    if source.conversion is Conversion.LIST:
        lens = step.seq_lens[source.source]
        return [*lens, *_padding_kv_lens(step, geometry.seqs - len(lens), geometry.tokens, geometry.seqs)]
    return list(_decode_ends(len(step.query_start_loc[source.source]), step.tokens, geometry.tokens, geometry.seqs))


@functools.lru_cache(maxsize=4096)
def _decode_ends(length: int, tokens: int, padded_tokens: int, padded_seqs: int) -> tuple[int, ...]:
    """The padded query ends of a decode step whose `query_start_loc` has `length` entries: that
    list is `_decode_start_loc(length)` (`read_step` decides decode by it), so its padding depends
    on the sizes only."""
    return tuple(padded_start_loc(_decode_start_loc(length), tokens, padded_tokens, padded_seqs)[1:])


@functools.lru_cache(maxsize=1024)
def _start_loc_tail(count: int, tokens: int, padded_tokens: int, padded_seqs: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The padded entries of `query_start_loc` after its `count` real ones (they depend on the sizes
    only), made once on the device so a step copies them device to device."""
    tail = padded_start_loc([0] * count, tokens, padded_tokens, padded_seqs)[count:]
    return torch.tensor(tail, dtype=dtype, device=device)


def padded_shape(spec: InputSpec, padded: dict) -> tuple[int, ...]:
    return tuple(evaluate(d, padded) for d in spec.shape)


#: One copy staging a step: (destination view in a static buffer, source), the source being the
#: step's input itself (None) or padding (a constant tensor expanded to the region).
StagingCopy = tuple[torch.Tensor, "torch.Tensor | None"]


def padded_copies(spec: InputSpec, shape: Sequence[int], dest: torch.Tensor, tokens: int,
                  padded_tokens: int) -> list[StagingCopy]:
    """The copies that put an input of `shape` (a step of `tokens` tokens) into its padded static
    buffer `dest`: the input into the leading region, the padding by the input's role into the rest."""
    if spec.role is Role.QUERY_START_LOC:
        count = shape[0]
        copies: list[StagingCopy] = [(dest[:count], None)]
        if count < dest.shape[0]:
            copies.append((dest[count:], _start_loc_tail(count, tokens, padded_tokens, dest.shape[0] - 1,
                                                         dest.dtype, dest.device)))
        return copies
    if tuple(shape) == tuple(dest.shape):  # nothing to pad
        return [(dest, None)]
    if any(a > p for a, p in zip(shape, dest.shape)):
        raise ValueError(f"{spec.name}: shape {tuple(shape)} does not fit the graph's padded shape "
                         f"{tuple(dest.shape)}{_too_large(spec, shape, dest.shape)}")
    copies = [(dest[tuple(slice(0, n) for n in shape)], None)]
    pad = torch.full((), PAD_VALUE.get(spec.role, 0), dtype=dest.dtype, device=dest.device)
    for dim, (actual, full) in enumerate(zip(shape, dest.shape)):
        if actual < full:
            region = dest[tuple(slice(0, shape[d]) for d in range(dim)) + (slice(actual, None),)]
            copies.append((region, pad.expand(region.shape)))
    return copies


def _too_large(spec: InputSpec, shape: Sequence[int], padded: Sequence[int]) -> str:
    """What of a block table `shape` exceeds its graph's `padded` shape (rows, width), in words."""
    if spec.role is not Role.BLOCK_TABLE or len(shape) != 2:
        return ""
    why = [f"block_table has {shape[0]} rows, more than the graph's {padded[0]} sequences: it takes one row per "
           f"sequence of the step, as many as seq_lens has"] if shape[0] > padded[0] else []
    why += ["block_table is wider than max_model_len / block_size"] if shape[1] > padded[1] else []
    return f" ({'; '.join(why)})"


def gather(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """A function picking `indices` out of a step's arguments as a tuple, at C speed."""
    if len(indices) == 1:
        (index,) = indices
        return lambda args: (args[index],)
    return operator.itemgetter(*indices) if indices else (lambda args: ())


def step_kind(step: Step) -> str:
    """"decode" (one query token per sequence), "prefill" (none with one) or "mixed"."""
    if step.decode:
        return "decode"
    loc = next(iter(step.query_start_loc.values()), None)
    if loc is None:
        return "mixed"
    return "prefill" if all(b - a > 1 for a, b in zip(loc, loc[1:])) else "mixed"
