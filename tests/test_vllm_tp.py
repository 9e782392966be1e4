"""Tensor parallel on vLLM's own code (0.23.0 or 0.33.0, `tests/vllm_tp.py`): two gloo ranks, each
compiling its shard of vLLM's Llama through vLLM's mode-1 call, collectives through vLLM's custom ops
(`torch.ops.vllm.all_reduce`, CUDA's path); every step on every rank equal to that rank's eager model.
Skipped where vLLM does not import; `.ci/run` runs it in both vLLM venvs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from tests import vllm_tp  # noqa: E402
from tests.test_vllm_real import STEPS  # noqa: E402


def test_tp2_through_vllms_custom_op_all_reduce_equals_eager_on_every_rank(tmp_path) -> None:
    ranks = vllm_tp.spawn_ranks(STEPS, world=2, workdir=str(tmp_path))
    for rank, res in enumerate(ranks):
        assert "failure" not in res, f"rank {rank} raised:\n{res['failure']}"
        assert res["custom_op_collectives"], "vLLM did not take its custom-op collectives path"
        wrong = {i: e for i, e in enumerate(res["errors"]) if not e <= 1e-4}
        assert len(res["errors"]) == len(STEPS) and not wrong, f"rank {rank}: steps off eager: {wrong}"
        assert max(res["cache_errors"]) <= 1e-5, res["cache_errors"]
        assert res["stats"].get("replays", 0) >= 4, res["stats"]
    assert ranks[0]["stats"] == ranks[1]["stats"]
    # each rank reduced the other's partial sums: the two ranks' outputs agree
    for a, b in zip(ranks[0]["outputs"], ranks[1]["outputs"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
