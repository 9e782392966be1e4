"""The band's edge decided on the device (`ascend_compile/ops/npu/band_probe.py`, `band_edge`): whether
FIA's band of `pre_tokens` P attends P + 1 keys (the docs' band, torch_npu 2.14 `_op_plugin_docs.py`
L1636-1645, L8200: the binding then passes `W - 1`) or P (vLLM-Ascend's `pre_tokens = W`, `attention_v1.py`
L942: it passes `W`) is asked of the device by one call at several query tokens; where neither holds,
windowed layers run eagerly and the binding refuses them. The fake implements each reading
(`install(..., band_reading=)`); the models' runs under both are in `tests/test_npu_features.py`."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops.npu import band_probe as npu_band_probe
from examples.llama import LlamaConfig
from tests import fake_torch_npu
from tests.helpers import make_problem
from tests.test_npu import CPU, DTYPE, NPU_BLOCK
from tests.test_npu_features import (SINKS, STEPS, V1, V2, WINDOW, band_form, is_band_probe, run_replayed, served,
                                     window_served)


@pytest.mark.parametrize("reading, pre", [("docs", WINDOW - 1), ("vllm-ascend", WINDOW), ("neither", None)])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_the_band_edge_probe_finds_the_pre_tokens_of_the_devices_reading(monkeypatch, caplog, reading, pre, sinks):
    """The device decides which `pre_tokens` serves a window: one call at several query tokens with
    `pre_tokens` 15 compared with windows 15, 16 and 17, asked once per process, device and form, logged
    (a WARNING naming why where neither reading holds)."""
    fake = fake_torch_npu.install(monkeypatch, band_reading=reading)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    form = band_form(sinks)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        answers = [kernels.pre_tokens(WINDOW, form), kernels.pre_tokens(WINDOW, form),
                   npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU).pre_tokens(7, form)]
    assert answers == [pre, pre, None if pre is None else pre - WINDOW + 7]
    assert kernels.pre_tokens(None, form) is None
    assert fake.count(V2 if sinks else V1) == 1  # once
    edge = {"docs": 1, "vllm-ascend": 0, "neither": None}[reading]
    assert npu_band_probe.known_edges(kernels) == {form: edge}
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if "band edge probe" in r.getMessage()
              or "not served on FIA" in r.getMessage()]
    if pre is None:
        assert [level for level, _ in logged] == ["WARNING", "WARNING"]
        assert "neither W keys" in logged[1][1] and "L942" in logged[1][1] and "L1636-1645" in logged[1][1]
    else:
        assert logged == [("INFO", f"ascend_compile: FIA {form} on cpu attends "
                                   f"{15 + edge} keys for pre_tokens 15 at several query tokens (the band edge probe): "
                                   f"{npu_band_probe.READINGS[edge]}, windowed layers pass pre_tokens = "
                                   f"W{' - 1' if edge else ''}")]


@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_windowed_layers_run_eagerly_where_the_edge_probe_finds_neither_reading(monkeypatch, caplog, sinks):
    """A device whose band of `pre_tokens` W - 1 attends neither W nor W - 1 keys: no `pre_tokens` is
    guessed; every graph with a windowed layer serves its steps eagerly (equal eager), the binding refuses
    a windowed call naming why, and plan.json says so."""
    fake = fake_torch_npu.install(monkeypatch, band_at_single_query=True, band_reading="neither")
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=sinks,
                      layer_types=("full", "sliding"), sliding_window=WINDOW)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        artifacts = run_replayed(cfg, eager=len(STEPS))
    assert any("no pre_tokens is known to serve a window" in r.getMessage() for r in caplog.records)
    [how] = window_served(artifacts)
    assert how.startswith("eagerly, not on FIA")
    assert not [c for c in served(fake, V2 if sinks else V1) if c.kwargs["sparse_mode"] == 4]
    prob = make_problem([300, 9], [1, 3], block_size=NPU_BLOCK, dtype=DTYPE)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    out = torch.empty_like(prob.query)
    with pytest.raises(ValueError, match=r"window: a window of 24 is not served on FIA: .*neither W keys"):
        kernels.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, [1, 4],
                                      prob.seq_lens, prob.scale, torch.empty(1 << 22, dtype=torch.uint8), out, WINDOW,
                                      None, SINKS.to(DTYPE) if sinks else None)


def test_the_band_probes_are_asked_at_each_windowed_layers_own_form_once_per_form(monkeypatch):
    """The band probes call FIA with the layer's own heads, KV heads, head dim, dtype and blocks (a GQA layer
    of D 32 takes another tiling path than a D 16 one): once per distinct form, however many layers and
    compiles share it."""
    fake = fake_torch_npu.install(monkeypatch, band_at_single_query=True)
    for head_dim in (16, 16, 32):  # two compiles of one form, then another form
        cfg = LlamaConfig(dtype=DTYPE, num_layers=3, num_blocks=128, block_size=NPU_BLOCK, head_dim=head_dim,
                          hidden_size=128, layer_types=("sliding", "full", "sliding"), sliding_window=WINDOW)
        run_replayed(cfg, steps=[[30, 7], ([40, 3], [3, 1])])
    probes = [c for c in fake.calls if c.name == V1 and is_band_probe(c)]
    assert [(tuple(c.args[0].shape), c.args[0].dtype, tuple(c.args[1].shape[1:])) for c in probes] == [
        ((q, 4, d), DTYPE, (NPU_BLOCK, 2 * d)) for d in (16, 32) for q in (npu_band_probe.EDGE_QUERY_LEN, 1)]


@pytest.mark.parametrize("refused", ["every call", "one query token"])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_a_band_probe_call_the_device_refuses_is_read_as_neither(monkeypatch, caplog, refused, sinks):
    """A device refusing a probe's call (an aclnn error, torch_npu's RuntimeError) answers "neither": no window
    served on FIA where the edge probe's call is refused, the band not applied at S 1 where the S=1 call is;
    one WARNING with the device's message, no compile failure."""
    fake_torch_npu.install(monkeypatch, band_at_single_query=True)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    launch = kernels.launch_fia

    def refusing(query, *args):
        if refused == "every call" or query.shape[0] == 1:
            raise RuntimeError("EZ9999: fake aclnn: this form's band")
        return launch(query, *args)

    monkeypatch.setattr(kernels, "launch_fia", refusing)
    form = band_form(sinks)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        edge = npu_band_probe.band_edge(kernels, form)
        applies = npu_band_probe.band_at_single_query(kernels, form)
    assert (edge, applies) == ((None, False) if refused == "every call" else (1, False))
    assert [r.getMessage() for r in caplog.records if "refused a band probe" in r.getMessage()] == [
        "ascend_compile: the device refused a band probe's FIA call (read as neither reading): EZ9999: fake aclnn: "
        "this form's band"]
