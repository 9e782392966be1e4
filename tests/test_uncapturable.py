"""A graph holding an op the device cannot capture (issue 33, item 1): a custom op whose Python reads
device data on the host, beside the attention. The strict simulator (and the fake torch_npu on it)
refuses the read inside the capture, naming the op; the graph must still serve: its steps run eagerly,
one WARNING names the op, and no later step tries to capture it (or any graph holding it) again."""
from __future__ import annotations

import logging

import pytest
import torch

from examples import llama
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests.test_backend import compiled_model

#: Calls of the op's Python body, by who ran it ("compiled": the compiled model's steps and captures).
BODY_CALLS = {"compiled": 0, "eager": 0}
_CALLER = ["compiled"]


@torch.library.custom_op("uncapturable_test::host_gate", mutates_args=())
def host_gate(q: torch.Tensor) -> torch.Tensor:
    """Halves the rows whose first element is negative, deciding on the host (`.tolist()`): token-wise,
    and not capturable by a device graph."""
    BODY_CALLS[_CALLER[0]] += 1
    keep = [1.0 if v >= 0 else 0.5 for v in q[:, 0, 0].tolist()]
    return q * torch.tensor(keep, dtype=q.dtype).view(-1, 1, 1)


@host_gate.register_fake
def _(q):
    return torch.empty_like(q)


def _attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
    q = torch.ops.uncapturable_test.host_gate(q)
    torch.ops.ascend.reshape_and_cache(k, v, self.key_cache, self.value_cache, slot_mapping)
    return torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, seq_lens, query_start_loc,
                                      self.cfg.head_dim**-0.5)


STEPS = [[10, 20, 30], [40, 50, 60, 70], ([40, 300, 17], [3, 1, 2]), [5, 6], [8, 9, 10, 11, 12, 13, 14], [7] * 8]


def _serve(monkeypatch, caplog, runtime, dtype):
    monkeypatch.setattr(llama.Attention, "attend", _attend)
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=128, dtype=dtype)
    model, reference = build(cfg), build(cfg)
    # piecewise graphs off: the full graphs' behaviour (tests/test_piecewise.py serves the op between pieces)
    fn, artifacts = compiled_model(model, runtime=runtime, max_model_len=512, capture_sizes=(4, 8), pa_max_batch=4,
                                   piecewise_sizes=[])
    batch = PagedBatch(cfg, seed=5)
    BODY_CALLS.update(compiled=0, eager=0)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"):
        for step in STEPS:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            _CALLER[0] = "compiled"
            got = fn(**inputs)
            _CALLER[0] = "eager"
            torch.testing.assert_close(got, reference(**inputs), atol=0, rtol=0)  # the same ops, run eagerly
    _CALLER[0] = "compiled"
    return artifacts


@pytest.mark.parametrize("runtime", ["sim", "npu"])
def test_a_graph_with_an_uncapturable_op_serves_every_step_eagerly_warning_once(monkeypatch, caplog, runtime):
    warm_up = 0
    if runtime == "npu":
        fake_torch_npu.install(monkeypatch)
        warm_up = 1  # the npu runtime runs the graph eagerly before its capture
    artifacts = _serve(monkeypatch, caplog, runtime, torch.bfloat16)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(artifacts) >= 1  # one per compiled graph (dynamo's), naming the op
    assert all("uncapturable_test.host_gate.default" in w and "cannot be captured" in w for w in warnings)
    assert "Tensor.tolist()" in warnings[0]
    stats = sum((a.stats for a in artifacts), start=__import__("collections").Counter())
    assert stats["captures"] == stats["replays"] == 0 and stats["eager_fallbacks"] == len(STEPS)
    # Each artifact tried one capture (its first graph); its other graphs were never tried: the body ran
    # once per layer and step (eagerly), plus, per attempt, once in the capture (the first layer's call,
    # refused) and once per layer in its warm-up; never inside a replay.
    assert stats["uncapturable_graphs"] == len(artifacts)
    layers = 2
    assert BODY_CALLS["compiled"] == layers * len(STEPS) + len(artifacts) * (1 + warm_up * layers)
    assert BODY_CALLS["eager"] == layers * len(STEPS)
    plan = artifacts[-1].describe()
    reasons = [r for g in plan["graphs"].values() for r in g.get("not_captured", {}).values()]
    assert reasons and all("uncapturable_test.host_gate.default" in r for r in reasons)
