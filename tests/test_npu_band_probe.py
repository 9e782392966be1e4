"""The band probes' bookkeeping (`ascend_compile/ops/npu/band_probe.py`): a layer's band form, which calls are FIA's
S-1 branch, the answers kept once per torch_npu module, device and form and logged, and what a window's
`pre_tokens` is from the edge probe's answer. The probes' own calls against the fake device are
`tests/test_npu_band_edge.py`'s and `tests/test_npu_fake_forms.py`'s; here the probes are stand-ins counting
their questions."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_compile.ops import tiling
from ascend_compile.ops.npu import band_probe

BF16 = torch.bfloat16
FORM = band_probe.BandForm(4, 2, 16, BF16, 128, False)


class _Module:
    """A torch_npu module's stand-in: the answers are kept per module."""


class Kernels:
    def __init__(self, device="cpu"):
        self.torch_npu, self.device = _Module(), torch.device(device)


@pytest.fixture
def asked(monkeypatch):
    """The probes replaced by stand-ins answering from `answers` (edge, single) and counting the questions."""
    state = {"edge": 1, "single": True, "edges": [], "singles": []}

    def edge(kernels, form):
        state["edges"].append((str(kernels.device), form))
        return state["edge"]

    def single(kernels, form):
        state["singles"].append((str(kernels.device), form))
        return state["single"]

    monkeypatch.setattr(band_probe, "_edge_probe", edge)
    monkeypatch.setattr(band_probe, "_probe", single)
    return state


def test_a_band_form_is_a_layers_heads_head_dim_dtype_block_size_and_sinks():
    shape = tiling.AttentionShape(num_heads=8, num_kv_heads=2, head_dim=64, block_size=128)
    assert band_probe.form(shape, BF16, 1) == band_probe.BandForm(8, 2, 64, BF16, 128, True)
    assert band_probe.form(shape, torch.float16, 0) == band_probe.BandForm(8, 2, 64, torch.float16, 128, False)
    query, cache = torch.empty(3, 8, 64, dtype=BF16), torch.empty(5, 128, 2, 64, dtype=BF16)
    assert band_probe.form_of_call(query, cache, False) == band_probe.BandForm(8, 2, 64, BF16, 128, False)
    assert band_probe.form_of_call(query, cache, 1).sinks is True
    assert str(band_probe.BandForm(8, 2, 64, BF16, 128, True)) == (
        "v2-sinks (heads 8, KV heads 2, head dim 64, bfloat16, blocks of 128)")
    assert str(band_probe.BandForm(4, 4, 16, torch.float16, 256, False)) == (
        "v1 (heads 4, KV heads 4, head dim 16, float16, blocks of 256)")


def test_a_call_is_fias_s1_branch_where_every_sequence_has_one_query_token():
    assert band_probe.single_query([1]) and band_probe.single_query([1, 2, 3])
    assert band_probe.single_query(torch.tensor([1, 2], dtype=torch.int32))
    assert not band_probe.single_query([]) and not band_probe.single_query([2])
    assert not band_probe.single_query([1, 3]) and not band_probe.single_query([0, 1])


def test_the_s1_calls_the_two_readings_compute_apart_have_a_sequence_longer_than_the_window():
    assert band_probe.single_query_outside([1, 2], [16, 17], 16)
    assert not band_probe.single_query_outside([1, 2], [16, 16], 16)
    assert not band_probe.single_query_outside([1, 2], [40, 40], None)
    assert not band_probe.single_query_outside([2, 3], [40, 40], 16)


def test_the_edge_is_asked_once_per_module_device_and_form_and_logged(asked, caplog):
    kernels = Kernels()
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert band_probe.band_edge(kernels, FORM) == 1
        assert band_probe.band_edge(kernels, FORM) == 1
        assert asked["edges"] == [("cpu", FORM)]
        sinks = band_probe.BandForm(4, 2, 16, BF16, 128, True)
        asked["edge"] = 0
        assert band_probe.band_edge(kernels, sinks) == 0
        asked["edge"] = None
        kernels.device = torch.device("meta")
        assert band_probe.band_edge(kernels, FORM) is None
        assert band_probe.band_edge(Kernels(), FORM) is None  # another module asks again
    assert len(asked["edges"]) == 4
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages[0] == ("INFO", "ascend_compile: FIA v1 (heads 4, KV heads 2, head dim 16, bfloat16, blocks of 128) "
                           "on cpu attends 16 keys for pre_tokens 15 at several query tokens (the band edge probe): "
                           f"{band_probe.READINGS[1]}, windowed layers pass pre_tokens = W - 1")
    assert messages[1] == ("INFO", f"ascend_compile: FIA {sinks} on cpu attends 15 keys for pre_tokens 15 at several "
                           f"query tokens (the band edge probe): {band_probe.READINGS[0]}, windowed layers pass "
                           f"pre_tokens = W")
    assert messages[2] == ("WARNING", f"ascend_compile: FIA {FORM} on meta: {band_probe.EDGE_REFUSAL}")
    assert len(messages) == 4
    kernels.device = torch.device("cpu")
    assert band_probe.known_edges(kernels) == {FORM: 1, sinks: 0}
    kernels.device = torch.device("meta")
    assert band_probe.known_edges(kernels) == {FORM: None}
    assert band_probe.known_edges(Kernels()) == {}


@pytest.mark.parametrize("edge, window, pre", [(1, 24, 23), (0, 24, 24), (None, 24, None), (1, None, None),
                                               (0, None, None)])
def test_pre_tokens_is_the_window_less_the_edge_and_none_without_a_window_or_an_edge(asked, edge, window, pre):
    asked["edge"] = edge
    kernels = Kernels()
    got = band_probe.pre_tokens(kernels, window, FORM)
    assert got == pre and (got is None or type(got) is int)
    assert band_probe.windowed_refusal(kernels, FORM) == (band_probe.EDGE_REFUSAL if edge is None else None)
    assert len(asked["edges"]) == 1


def test_pre_tokens_of_a_tensor_window_is_an_int(asked):
    assert type(band_probe.pre_tokens(Kernels(), torch.tensor(24), FORM)) is int


@pytest.mark.parametrize("applies", [True, False])
def test_the_s1_band_is_asked_once_per_module_device_and_form_and_logged(asked, caplog, applies):
    asked["single"] = applies
    kernels = Kernels()
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert band_probe.band_at_single_query(kernels, FORM) is applies
        assert band_probe.band_at_single_query(kernels, FORM) is applies
    assert asked["singles"] == [("cpu", FORM)]
    assert [r.getMessage() for r in caplog.records] == [
        f"ascend_compile: FIA {FORM} on cpu {'applies' if applies else 'does not apply'} the band (sparse_mode 4, "
        "pre_tokens) to a call whose every sequence has one query token (the S=1 band probe): "
        + ("windowed layers keep their decode graphs" if applies else
           "decode steps with a sequence longer than a layer's window run eagerly")]
    assert band_probe.known(kernels) == {FORM: applies}
    kernels.device = torch.device("meta")
    assert band_probe.known(kernels) == {}
    assert band_probe.band_at_single_query(kernels, FORM) is applies and len(asked["singles"]) == 2
    assert band_probe.known(Kernels()) == {}


def test_the_probes_sinks_are_bfloat16_one_per_query_head():
    assert band_probe._sinks(FORM) is None
    for heads in (1, 4, 5):
        sink = band_probe._sinks(band_probe.BandForm(heads, 1, 16, torch.float16, 128, True))
        assert sink.dtype == BF16 and sink.tolist() == [0.5, -0.5] * (heads // 2) + [0.5] * (heads % 2)


class _Refusing(Kernels):
    """A device of another kind than the host's, recording the probe's call and refusing its kernel."""

    def __init__(self):
        super().__init__("meta")
        self.calls = []

    def band_workspace_nbytes(self, *args):
        self.calls.append(("workspace", args))
        return 96

    def launch_fia(self, *args):
        self.calls.append(("launch", args))
        raise RuntimeError("EZ9999: refused")


@pytest.mark.parametrize("sinks", [False, True])
def test_a_probes_call_is_made_on_the_kernels_device_with_its_workspace_and_a_refusal_read_as_none(sinks, caplog):
    # the probe's host tensors moved to the device, its workspace query answered with `out` and the band, the
    # workspace of that many bytes on the device; a RuntimeError read as no output (logged)
    kernels = _Refusing()
    query, cache = torch.zeros(4, 4, 16, dtype=BF16), torch.zeros(2, 128, 2, 16, dtype=BF16)
    table, sink = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(4, dtype=BF16) if sinks else None
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert band_probe._device_output(kernels, query, cache, cache, table, 0.25, 15, sink) is None
    (_, asked), (_, launched) = kernels.calls
    q, k, v, t, ends, kv_lens, scale, out, pre, s = asked
    assert all(x.device.type == "meta" for x in (q, k, v, t, out)) and ends == [4] and kv_lens == [200]
    assert scale == 0.25 and pre == 15 and out.shape == q.shape
    assert (s is None) if not sinks else (s.device.type == "meta" and s.shape == (4,))
    workspace = launched[7]
    assert workspace.device.type == "meta" and workspace.dtype == torch.uint8 and workspace.numel() == 96
    assert launched[8] is not None and launched[9] == 15 and (launched[10] is None) == (not sinks)
    assert ["the device refused a band probe's FIA call (read as neither reading): EZ9999: refused" in r.getMessage()
            for r in caplog.records] == [True]
