"""A warm start repeats nothing deterministic (issue 48, item 4): with `plan_dir`, a second compile of
the same graph, options, versions, device and rank takes the kernel timings and workspace queries of
the first from its persisted plan (none asked); any key part changed is a plan of its own, asked anew."""
from __future__ import annotations

import pytest
import torch

import ascend_compile
from ascend_compile import cli, plan_cache
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

TINY = dict(vocab_size=32, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16, num_blocks=64)


def _start(plan_dir, layers=2, **options):
    """One start: compile (kernel_policy "auto": every bucket's kernels timed) and serve one step; the
    artifact."""
    cfg = LlamaConfig(num_layers=layers, **TINY)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(**{"max_model_len": 256, "capture_sizes": (4, 8), "piecewise_sizes": (16,),
                              "kernel_policy": "auto", "plan_dir": str(plan_dir), **options})
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=2).step([30, 40, 50]))
    return artifacts[0]


def _npu_start(plan_dir, **layout):
    """One start on the fake torch_npu: a bf16 model of blocks of 128 (`layout`: its other fields) compiled
    with the default kernel policy, one step served; the artifact."""
    cfg = LlamaConfig(num_layers=2, num_blocks=64, block_size=128, dtype=torch.bfloat16, **layout)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 8), piecewise_sizes=(16,), runtime="npu",
                           plan_dir=str(plan_dir))
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=2).step([30, 40, 50]))
    return artifacts[0]


def _plan(art) -> dict:
    return art.describe()["startup"]["plan"]


def test_a_warm_start_times_no_kernel_and_chooses_the_same_kernels(tmp_path):
    cold = _start(tmp_path)
    warm = _start(tmp_path)
    assert _plan(cold)["asked"]["kernel_timing"] >= 4 and not _plan(cold)["reused"]
    assert _plan(warm)["asked"] == {} and _plan(warm)["reused"] == _plan(cold)["asked"]
    assert _plan(warm)["file"] == _plan(cold)["file"]
    assert "kernel_timing" in cold.startup.phases and "kernel_timing" not in warm.startup.phases
    choices = lambda art: {str(k): [c.kernel for c in v] for k, v in art.rewritten.choices.items()}  # noqa: E731
    assert choices(warm) == choices(cold)
    assert f"reused {{'kernel_timing': {_plan(cold)['asked']['kernel_timing']}}}, asked {{}}" in "\n".join(
        cli._render_startup(warm.describe()))


#: each part of the key, changed as it would change between two starts
KEY_PARTS = {
    "graph": lambda mp: {"layers": 3},
    "options": lambda mp: {"auto_seq_len": 64},
    "torch": lambda mp: mp.setattr(torch, "__version__", torch.__version__ + "+other"),
    "torch_npu": lambda mp: mp.setattr(plan_cache, "_version", lambda dist: "2.10.0.post5"),
    "cann": lambda mp: mp.setattr(plan_cache, "cann_version", lambda: "Version=8.5.0"),
    "device": lambda mp: mp.setattr(plan_cache, "device_name", lambda device: "cuda:0 NVIDIA H200 sm(9, 0)"),
    "rank": lambda mp: (mp.setattr(torch.distributed, "is_initialized", lambda: True),
                        mp.setattr(torch.distributed, "get_rank", lambda: 1)),
}


@pytest.mark.parametrize("part", list(KEY_PARTS))
def test_any_part_of_the_key_changed_means_the_plan_is_asked_anew(tmp_path, monkeypatch, part):
    cold = _start(tmp_path)
    with monkeypatch.context() as mp:
        changed = KEY_PARTS[part](mp)
        options = changed if isinstance(changed, dict) else {}
        layers = options.pop("layers", 2)
        other = _start(tmp_path, layers=layers, **options)
    assert _plan(other)["file"] != _plan(cold)["file"] and not _plan(other)["reused"]
    assert _plan(other)["asked"].get("kernel_timing", 0) > 0


def test_on_npu_a_warm_start_asks_no_workspace_query(tmp_path, monkeypatch):
    """The fake torch_npu's workspace queries (PA's and FIA's), asked per graph at compile time: none on the
    warm start, and the workspace slots the same."""
    fake_torch_npu.install(monkeypatch)
    arts = [_npu_start(tmp_path) for _ in range(2)]
    cold, warm = (_plan(a) for a in arts)
    assert cold["asked"]["workspace_queries"] > 0 and warm["asked"] == {}
    assert warm["reused"]["workspace_queries"] >= cold["asked"]["workspace_queries"]
    assert {n: s.nbytes for n, s in arts[0].rewritten.plan.slots.items()} == {
        n: s.nbytes for n, s in arts[1].rewritten.plan.slots.items()}


def test_on_npu_a_warm_start_calls_no_probe(tmp_path, monkeypatch):
    """The FIA form probe (`ops/npu/form_probe.py`) and a windowed layer's band probes (`ops/npu/band_probe.py`)
    make real calls on the device at compile time: a cold start makes them (their answers kept in the plan), a
    warm start, in a fresh fake torch_npu (a new process: no answer held in memory), calls none and serves the
    same (the windowed layer's decode steps replayed, as the probes found the band applied at one query token)."""
    from tests.test_npu_features import V1, V2, is_probe

    arts, probes = [], []
    for _ in range(2):
        fake = fake_torch_npu.install(monkeypatch, band_at_single_query=True)
        arts.append(_npu_start(tmp_path, layer_types=("full", "sliding"), sliding_window=24))
        probes.append(sum(c.name in (V1, V2) and is_probe(c) for c in fake.calls))
    cold, warm = (_plan(a) for a in arts)
    assert probes[0] >= 4 and cold["asked"]["npu_probes"] >= 3  # the form's two calls, each band probe's one
    assert probes[1] == 0 and warm["asked"] == {} and warm["reused"]["npu_probes"] == cold["asked"]["npu_probes"]
    assert arts[1].served == arts[0].served and arts[1].served[("decode", "full")] == 1
