"""The inputs one vLLM attention-metadata object (a KV-cache group) provides, and their host copies.

Each group gives its `seq_lens`, `query_start_loc[:num_reqs + 1]` and block table (vLLM-Ascend's
also the attention op's slots) as provided inputs (`binder.py`). The runner reads the
two length inputs on the host every step (`lowering/inputs.py: read_step`); a device tensor costs a
device-to-host sync there. vLLM-Ascend's `AscendMetadata` keeps host copies beside them:
`seq_lens_list` and `actual_seq_lengths_q` (the cumulative query ends, without the leading 0), and
`HostLengths` gives those to the runner instead (`Provider.host`), so a step reads no length from
the device.

Why they are the step's lengths: `AscendAttentionMetadataBuilder.build` (vLLM-Ascend
`attention/attention_v1.py`) makes both from the same host buffers in the same call:
`query_start_loc = query_start_loc_cpu.pin_memory().to(device)` and `actual_seq_lengths_q =
query_start_loc_cpu[1:].tolist()`; `seq_lens_list = seq_lens.tolist()`, the dummy padding request
it appends for FIA's TND layout (graph or sequence-parallel padding) going into the lists and the
tensors alike. vLLM-Ascend's own FIA calls take these lists as `actual_seq_lengths` /
`actual_seq_lengths_kv`, so a graph reading them computes what vLLM-Ascend's eager step does. What
is cheap to check is checked each step: one entry per sequence of the `seq_lens` tensor in both
lists, ends that cover the step's `num_actual_tokens`, a `query_start_loc` long enough. A copy
failing a check is not used: that step reads the tensors, and a warning says why (once).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from torch import fx

from ...passes.providers import fake_like, fresh_size
from .context import attention_slots, block_table, metadata_of, query_start_loc

log = logging.getLogger("ascend_compile")


def bind_metadata(index: int, layer: str, metadata: Any, tokens: Any, fake_mode: Any,
                  provide: Callable[..., fx.Node]) -> dict[str, fx.Node]:
    """The provided inputs of one metadata object (every layer sharing it), by the attention
    argument they feed; `provide(name, source, read, fake, host=None)` adds one."""
    table_field = "block_table" if hasattr(metadata, "block_table") else "block_tables"
    where = f"forward_context.attn_metadata[{layer!r}]"
    seq_lens = metadata.seq_lens
    seqs = fresh_size(fake_mode, seq_lens.shape[0], f"seqs_{index}")
    table = getattr(metadata, table_field)
    names = f"vllm_seq_lens_{index}", f"vllm_query_start_loc_{index}"
    host = HostLengths(layer, *names) if HostLengths.kept_by(metadata) else None
    lens_copy, loc_copy = (" (on the host: .seq_lens_list)", " (on the host: [0] + .actual_seq_lengths_q)") \
        if host is not None else ("", "")
    inputs = {
        "seq_lens": provide(names[0], f"{where}.seq_lens{lens_copy}", lambda ctx: metadata_of(ctx, layer).seq_lens,
                            fake_like(fake_mode, seq_lens, (seqs,)), host),
        "query_start_loc": provide(
            names[1], f"{where}.query_start_loc[:num_reqs + 1]{loc_copy}",
            lambda ctx: query_start_loc(metadata_of(ctx, layer)),
            fake_like(fake_mode, metadata.query_start_loc, (seqs + 1,))),
        "block_table": provide(
            f"vllm_block_table_{index}", f"{where}.{table_field}[:num_reqs]",
            lambda ctx: block_table(metadata_of(ctx, layer), table_field),
            fake_like(fake_mode, table, (seqs, table.shape[1]))),
    }
    if hasattr(metadata, "slot_mapping") and hasattr(metadata, "block_tables"):  # vLLM-Ascend: the op writes
        inputs["slot_mapping"] = provide(
            f"vllm_slot_mapping_{index}", f"{where}.slot_mapping[:num_actual_tokens]",
            lambda ctx: attention_slots(metadata_of(ctx, layer)),
            fake_like(fake_mode, metadata.slot_mapping, (tokens,)))
    return inputs


class HostLengths:
    """vLLM-Ascend's host copies of one metadata group's `seq_lens` and `query_start_loc`, for the
    inputs named `seq_lens_input` and `query_start_loc_input` (see the module docstring)."""

    FIELDS = ("seq_lens_list", "actual_seq_lengths_q")

    def __init__(self, layer: str, seq_lens_input: str, query_start_loc_input: str) -> None:
        self.layer, self.names = layer, (seq_lens_input, query_start_loc_input)
        self.warned = False  # a failed check is logged at WARNING once, then at DEBUG

    @classmethod
    def kept_by(cls, metadata: Any) -> bool:
        """Whether the metadata class keeps the host copies (vLLM-Ascend's `AscendMetadata` does)."""
        return all(hasattr(metadata, field) for field in cls.FIELDS)

    def __call__(self, ctx: Any) -> dict[str, list[int]]:
        """The step's host copies by input name; none where they fail a check."""
        metadata = metadata_of(ctx, self.layer)
        lens, ends = metadata.seq_lens_list, metadata.actual_seq_lengths_q
        problem = self.problem(metadata, lens, ends)
        if problem is None:
            return {self.names[0]: lens, self.names[1]: [0, *ends]}
        if not self.warned:
            self.warned = True
            log.warning("ascend_compile: forward_context.attn_metadata[%r]: %s; reading seq_lens and "
                        "query_start_loc from their tensors instead (a device-to-host sync per step; logged once)",
                        self.layer, problem)
        else:
            log.debug("ascend_compile: forward_context.attn_metadata[%r]: %s", self.layer, problem)
        return {}

    @staticmethod
    def problem(metadata: Any, lens: Any, ends: Any) -> str | None:
        """Why the host copies are not the step's lengths (None: they pass every cheap check)."""
        seqs = metadata.seq_lens.shape[0]
        if not isinstance(lens, list) or not isinstance(ends, list):
            return f"seq_lens_list / actual_seq_lengths_q are not lists ({type(lens).__name__}, {type(ends).__name__})"
        if len(lens) != seqs or len(ends) != seqs:
            return (f"seq_lens_list ({len(lens)} entries) and actual_seq_lengths_q ({len(ends)}) do not have one "
                    f"entry per sequence of seq_lens ({seqs})")
        if metadata.query_start_loc.shape[0] < seqs + 1:
            return f"query_start_loc has {metadata.query_start_loc.shape[0]} entries for {seqs} sequences"
        if seqs and ends[-1] < metadata.num_actual_tokens:
            return (f"actual_seq_lengths_q ends at {ends[-1]}, before the step's num_actual_tokens="
                    f"{metadata.num_actual_tokens} (stale)")
        return None

