"""A vLLM metadata group's provided inputs and vLLM-Ascend's host lengths (`integrations/vllm/metadata.py`),
without vLLM: the inputs each group provides (their names, the forward-context fields they read, cut to
the step, their fakes), and the host copies' checks. Milliseconds a test (the module's mutation
selection, `tools/mutation/modules.toml`)."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ascend_compile.integrations.vllm import metadata

NS = types.SimpleNamespace


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="ascend_compile")
    return caplog


# --------------------------------------------------------------------------------------------- metadata.py


def _ascend_metadata(seqs=3, loc=4, tokens=5, lens=None, ends=None, host=True, table="block_tables"):
    meta = NS(seq_lens=torch.tensor([7, 8, 9][:seqs] + [1] * max(0, seqs - 3), dtype=torch.int32),
              query_start_loc=torch.arange(loc, dtype=torch.int32) * 2, num_actual_tokens=tokens,
              slot_mapping=torch.arange(10, dtype=torch.int32))
    setattr(meta, table, torch.arange(seqs * 6, dtype=torch.int32).view(seqs, 6) if seqs else torch.zeros(0, 6))
    if host:
        meta.seq_lens_list = list(range(seqs)) if lens is None else lens
        meta.actual_seq_lengths_q = [2 * (i + 1) for i in range(seqs)] if ends is None else ends
    return meta


def _bind(meta, index=2, layer="model.layers.0.attn", tokens=17):
    provided = {}

    def provide(name, source, read, fake, host=None):
        provided[name] = (source, read, fake, host)
        return f"node:{name}"

    mode = FakeTensorMode(shape_env=ShapeEnv())
    inputs = metadata.bind_metadata(index, layer, meta, tokens, mode, provide)
    return inputs, provided


def _ctx(meta, layer="model.layers.0.attn"):
    return NS(attn_metadata={layer: meta})


def test_flash_attention_metadata_provides_lengths_cut_to_the_sequences_and_the_block_table():
    meta = _ascend_metadata(host=False, table="block_table", loc=6)
    inputs, provided = _bind(meta)
    assert inputs == {"seq_lens": "node:vllm_seq_lens_2", "query_start_loc": "node:vllm_query_start_loc_2",
                      "block_table": "node:vllm_block_table_2"}
    where = "forward_context.attn_metadata['model.layers.0.attn']"
    assert {name: p[0] for name, p in provided.items()} == {
        "vllm_seq_lens_2": f"{where}.seq_lens", "vllm_query_start_loc_2": f"{where}.query_start_loc[:num_reqs + 1]",
        "vllm_block_table_2": f"{where}.block_table[:num_reqs]"}
    assert all(p[3] is None for p in provided.values())
    step = _ascend_metadata(seqs=2, loc=9, host=False, table="block_table")
    ctx = _ctx(step)
    assert provided["vllm_seq_lens_2"][1](ctx) is step.seq_lens
    assert provided["vllm_query_start_loc_2"][1](ctx).tolist() == [0, 2, 4]
    assert provided["vllm_block_table_2"][1](ctx).tolist() == step.block_table[:2].tolist()


def test_the_fakes_have_one_fresh_symbolic_sequence_count_and_the_steps_dtypes():
    meta = _ascend_metadata(host=False, table="block_table")
    _, provided = _bind(meta, index=5)
    lens, loc, table = (provided[n][2] for n in ("vllm_seq_lens_5", "vllm_query_start_loc_5", "vllm_block_table_5"))
    (seqs,) = lens.shape
    assert isinstance(seqs, torch.SymInt) and str(seqs.node.expr).startswith("s")
    (source, *_) = seqs.node.shape_env.var_to_sources[seqs.node.expr]  # named after its group, in guards too
    assert source.name == "ascend_provided_seqs_5"
    # symbolic sizes compared as expressions (`==` on a SymInt answers by its hint)
    assert str(loc.shape[0]) == f"{seqs} + 1" and str(table.shape[0]) == str(seqs) and table.shape[1] == 6
    assert isinstance(table.shape[0], torch.SymInt) and isinstance(loc.shape[0], torch.SymInt)
    assert all(t.dtype == torch.int32 for t in (lens, loc, table))


def test_vllm_ascends_metadata_also_provides_the_ops_slots_cut_to_the_steps_tokens():
    meta = _ascend_metadata(host=False)
    inputs, provided = _bind(meta, index=0, layer="l", tokens=11)
    assert inputs["block_table"] == "node:vllm_block_table_0" and inputs["slot_mapping"] == "node:vllm_slot_mapping_0"
    assert provided["vllm_block_table_0"][0] == "forward_context.attn_metadata['l'].block_tables[:num_reqs]"
    assert provided["vllm_slot_mapping_0"][0] == "forward_context.attn_metadata['l'].slot_mapping[:num_actual_tokens]"
    step = _ascend_metadata(seqs=1, tokens=4, host=False)
    ctx = _ctx(step, "l")
    assert provided["vllm_slot_mapping_0"][1](ctx).tolist() == [0, 1, 2, 3]
    assert provided["vllm_block_table_0"][1](ctx).tolist() == [list(range(6))]
    slots = provided["vllm_slot_mapping_0"][2]
    assert tuple(slots.shape) == (11,) and slots.dtype == torch.int32


def test_slots_are_provided_only_where_the_op_writes_the_cache():
    meta = _ascend_metadata(host=False, table="block_table")  # a slot mapping, but FLASH_ATTN's table
    inputs, _ = _bind(meta)
    assert "slot_mapping" not in inputs


def test_vllm_ascends_host_lengths_are_given_to_the_seq_lens_input():
    meta = _ascend_metadata()
    _, provided = _bind(meta, index=1, layer="l")
    source, _, _, host = provided["vllm_seq_lens_1"]
    assert source == "forward_context.attn_metadata['l'].seq_lens (on the host: .seq_lens_list)"
    assert provided["vllm_query_start_loc_1"][0] == (
        "forward_context.attn_metadata['l'].query_start_loc[:num_reqs + 1] (on the host: [0] + .actual_seq_lengths_q)")
    assert isinstance(host, metadata.HostLengths) and (host.layer, host.names) == (
        "l", ("vllm_seq_lens_1", "vllm_query_start_loc_1"))
    assert host(_ctx(_ascend_metadata(), "l")) == {"vllm_seq_lens_1": [0, 1, 2], "vllm_query_start_loc_1": [0, 2, 4, 6]}


def test_host_copies_are_kept_only_by_metadata_with_both_lists():
    assert metadata.HostLengths.FIELDS == ("seq_lens_list", "actual_seq_lengths_q")
    assert metadata.HostLengths.kept_by(_ascend_metadata())
    half = _ascend_metadata()
    del half.actual_seq_lengths_q
    assert not metadata.HostLengths.kept_by(half)
    half = _ascend_metadata()
    del half.seq_lens_list
    assert not metadata.HostLengths.kept_by(half)


@pytest.mark.parametrize("meta, problem", [
    (_ascend_metadata(lens=(0, 1, 2)), "seq_lens_list / actual_seq_lengths_q are not lists (tuple, list)"),
    (_ascend_metadata(ends=torch.tensor([2, 4, 6])), "seq_lens_list / actual_seq_lengths_q are not lists (list, Tensor)"),
    (_ascend_metadata(lens=[1, 2]), "seq_lens_list (2 entries) and actual_seq_lengths_q (3) do not have one entry per "
                                    "sequence of seq_lens (3)"),
    (_ascend_metadata(ends=[2, 4, 6, 8]), "seq_lens_list (3 entries) and actual_seq_lengths_q (4) do not have one "
                                          "entry per sequence of seq_lens (3)"),
    (_ascend_metadata(loc=3), "query_start_loc has 3 entries for 3 sequences"),
    (_ascend_metadata(tokens=7), "actual_seq_lengths_q ends at 6, before the step's num_actual_tokens=7 (stale)"),
])
def test_host_copies_failing_a_check_are_named_why(meta, problem):
    assert metadata.HostLengths.problem(meta, meta.seq_lens_list, meta.actual_seq_lengths_q) == problem


@pytest.mark.parametrize("meta", [_ascend_metadata(), _ascend_metadata(tokens=6, loc=9), _ascend_metadata(tokens=0),
                                  _ascend_metadata(seqs=0, loc=1, tokens=3, lens=[], ends=[])])
def test_host_copies_passing_every_check_are_the_steps(meta):
    assert metadata.HostLengths.problem(meta, meta.seq_lens_list, meta.actual_seq_lengths_q) is None


def test_a_failed_check_reads_the_tensors_warning_once_then_at_debug(logs):
    host = metadata.HostLengths("l", "lens", "loc")
    assert host.warned is False
    stale = _ctx(_ascend_metadata(tokens=9), "l")
    assert host(stale) == {} and host(stale) == {}
    assert [r.levelno for r in logs.records] == [logging.WARNING, logging.DEBUG]
    assert logs.messages == [
        "ascend_compile: forward_context.attn_metadata['l']: actual_seq_lengths_q ends at 6, before the step's "
        "num_actual_tokens=9 (stale); reading seq_lens and query_start_loc from their tensors instead (a "
        "device-to-host sync per step; logged once)",
        "ascend_compile: forward_context.attn_metadata['l']: actual_seq_lengths_q ends at 6, before the step's "
        "num_actual_tokens=9 (stale)"]
    assert host(_ctx(_ascend_metadata(), "l")) == {"lens": [0, 1, 2], "loc": [0, 2, 4, 6]}
