"""vLLM's EAGLE drafter and its Llama target, both compiled by us, on vLLM's own code, 0.23.0 or 0.33.0
(`tests/vllm_eagle.py`): 20+ steps of vLLM's padded-batch speculative loop mixing speculative and plain
decode requests, prefills, steps proposing fewer drafts than k and requests taking fewer, each step's
drafts used, accepted and proposed equal to vLLM's eager models, hidden states close, and both models'
graphs captured and replayed, each with its own artifact and update table. Skipped where vLLM does not
import (the main venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile import torch_support  # noqa: E402
from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_eagle as eagle  # noqa: E402

#: Per step: the drafts the drafter proposes (k_step <= K: vLLM 0.33's `num_speculative_tokens_per_batch_size`
#: lowers it by batch size) and the drafts a request may take ({index: n}: a scheduler's truncation).
SCHEDULE = [(3, {}), (3, {}), (2, {1: 1}), (1, {}), (3, {0: 2}), (3, {}), (3, {}), (2, {}), (3, {2: 0}),
            (1, {}), (3, {3: 1}), (3, {}), (2, {}), (3, {}), (3, {0: 1, 1: 2}), (1, {}), (3, {}), (3, {}),
            (2, {}), (3, {}), (3, {1: 0}), (3, {}), (2, {}), (3, {})]
#: (prompt length, speculative, the step it joins at): request 2 is a plain decode request throughout.
REQUESTS = [(7, True, 0), (12, True, 0), (5, False, 0), (9, True, 6)]


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts per backend made, make): the first backend is the target's (vLLM's mode-1 call), the
    second the drafter's."""
    made = []
    original = integration.backend

    def recording(*args, **kwargs):
        artifacts = []
        made.append(artifacts)
        return original(*args, on_compiled=artifacts.append, **kwargs)

    monkeypatch.setattr(integration.dynamo_backend, "backend", recording)  # where configured_backend looks it up
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()
    yield made, lambda **kwargs: eagle.compiled_and_eager(monkeypatch, tmp_path, **kwargs)
    torch._dynamo.reset()


def _requests(step: int) -> list[eagle.Request]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n, _, _ in REQUESTS]
    return [eagle.Request(p, speculative=s) for p, (_, s, joins) in zip(prompts, REQUESTS) if joins <= step]


def _run(pairs, schedule) -> tuple[int, int]:
    """`schedule`'s steps on both pairs in lockstep, each equal: drafts used, accepted and proposed, the
    target's and every drafter pass's hidden states; then every KV cache. (accepted, used) drafts."""
    batches = [_requests(0), _requests(0)]
    accepted = used = 0
    for i, (k_step, truncate) in enumerate(schedule):
        for batch in batches:
            batch.extend(_requests(i)[len(batch):])
        got, expected = (eagle.engine_step(pair, batch, k_step, truncate) for pair, batch in zip(pairs, batches))
        assert (got.used, got.accepted, got.proposed) == (expected.used, expected.accepted, expected.proposed), i
        assert [len(p) for p in got.proposed] == [k_step] * len(batches[0]), i
        torch.testing.assert_close(got.target_hidden, expected.target_hidden, atol=2e-5, rtol=1e-4)
        assert len(got.drafter_hidden) == k_step
        for g, e in zip(got.drafter_hidden, expected.drafter_hidden):
            torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)
        accepted += sum(map(len, got.accepted))
        used += sum(map(len, got.used))
    for got, expected in zip(pairs[0].target.caches() + pairs[0].drafter.caches(),
                             pairs[1].target.caches() + pairs[1].drafter.caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    return accepted, used


def real_layers() -> list[str]:
    return [eagle.real.LAYER.format(i) for i in range(3)]


def _captured(art) -> set[str]:
    """The keys of the artifact's full graphs captured (`b4.decode`, `b16.mixed`, ...)."""
    return {str(key[0]) for key, entry in art.graphs.items() if entry.graph is not None}


def test_eagle_drafter_and_target_compiled_by_us_propose_and_accept_as_eager(compiled):
    """24 steps of vLLM's speculative loop: three speculative requests and a plain decode one (its drafts
    never taken), a fourth joining with its prefill beside the others' drafts, the drafter proposing
    3, 2 or 1 drafts a step and requests taking fewer than they were given; the target compiled by vLLM's
    mode-1 call, the drafter by ours: every step's drafts used, accepted and proposed equal to vLLM's eager
    models, hidden states and caches close. Each model its own artifact, its graphs captured and
    replayed: the target's 1 + d token steps (mixed graphs), the drafter's first passes (mixed) and its
    one-token steps (decode); only the two prefill steps above the largest bucket run on pieces. Where the
    vLLM fast path is armed (torch 2.14), every call of either model after its first skips dynamo."""
    made, make = compiled
    pairs = make(options={"capture_sizes": [4, 8, 16]})
    accepted, used = _run(pairs, SCHEDULE)
    assert 0 < accepted < used, (accepted, used)  # drafts both accepted and rejected
    (target,), (drafter,) = made  # one artifact per model, each traced once for every step size
    prefills = 2  # the first step (three prompts), the fourth request's (beside three drafted decodes)
    assert target.stats["steps"] == len(SCHEDULE) and drafter.stats["steps"] == sum(k for k, _ in SCHEDULE)
    for art in (target, drafter):
        assert art.stats["eager_fallbacks"] == 0 and art.stats["piecewise_steps"] == prefills, art.stats
        assert art.stats["replays"] == art.stats["steps"] - prefills, art.stats
    assert {"b16.mixed"} <= _captured(target), _captured(target)
    assert {"b4.decode", "b16.mixed"} <= _captured(drafter), _captured(drafter)
    if torch_support.armed_fast_paths()["vllm_fast_path"]:  # 0.33's torch: both skip dynamo after one step
        calls = [part.model._compiled_call_impl for part in (pairs[0].target, pairs[0].drafter)]
        assert all(isinstance(c, integration.fast_path.DirectCall) and c.dynamo_calls == 1 for c in calls), calls
    read = [" ".join(p["source"] for p in art.rewritten.prologue.provider.describe()) for art in (target, drafter)]
    layers = [{name for name in real_layers() if f"['{name}']" in sources} for sources in read]
    assert layers == [set(pairs[0].target.names), {eagle.DRAFTER_LAYER}], layers  # each its own layers' metadata


def test_the_plugin_compiles_the_drafter_beside_the_target_named_in_one_workspace_group(compiled, tmp_path):
    """vLLM-Ascend's plug-in (`compile_loaded`, after `load_model`) compiles the runner's drafter too. Each
    model is named by vLLM's tag for it (`backbone`, `eagle_head`): its plans under that name, each with
    its own update table (the target's kernels refreshed from the target's layers' lengths, the drafter's
    from its own layer's), and `inspect` shows both; the two share one workspace group: one slot, sized
    for the larger need (at max_model_len 512 the simulator's kernels need one), less than a slot each."""
    from ascend_compile import cli
    from ascend_compile.integrations.vllm import ascend_plugin

    made, make = compiled
    dump = tmp_path / "dump"
    pairs = make(options={"capture_sizes": [4, 8, 16], "dump_dir": str(dump)}, compile=False, max_model_len=512)
    runner = types.SimpleNamespace(vllm_config=pairs[0].target.config, model=pairs[0].target.model,
                                   drafter=types.SimpleNamespace(model=pairs[0].drafter.model))
    ascend_plugin.compile_loaded(runner)
    _run(pairs, SCHEDULE[:5])
    (target,), (drafter,) = made
    assert target.stats["replays"] > 0 and drafter.stats["replays"] > 0
    plans = {os.path.relpath(p, dump).split(os.sep)[0]: json.loads(Path(p).read_text()) for p in cli.find_plans(str(dump))}
    assert sorted(plans) == ["backbone", "eagle_head"], sorted(plans)
    for name, layer in (("backbone", eagle.real.LAYER.format(0)), ("eagle_head", eagle.DRAFTER_LAYER)):
        plan = plans[name]
        assert plan["model"] == name
        sources = " ".join(p["source"] for p in plan["provided_inputs"])
        assert f"attn_metadata['{layer}'].seq_lens" in sources, (name, sources)
        assert (eagle.DRAFTER_LAYER in sources) == (name == "eagle_head"), (name, sources)
        assert any("update_table" in g for g in plan["graphs"].values()), name
    assert target.group is drafter.group is not None
    group = target.group.describe()
    assert sorted(m["model"] for m in group["members"]) == ["backbone", "eagle_head"], group
    assert 0 < group["slot_bytes"] == max(m["needs_bytes"] for m in group["members"]) < group["separate_slots_bytes"]
    out = io.StringIO()  # not capsys: vLLM's process-group set-up reads the real stdout's descriptor
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", str(dump)]) == 0
    out = out.getvalue()
    assert f"== {dump / 'backbone'}" in out and f"== {dump / 'eagle_head'}" in out, out[:2000]


def test_each_engine_names_its_two_models_and_gives_them_one_workspace_group_of_its_own(tmp_path):
    """The options vLLM's config gives: with a drafter, the target named `backbone`, the drafter
    `eagle_head`, both in one workspace group, another engine's pair in another; without one, neither."""
    from ascend_compile.integrations.vllm import options

    configs = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        configs.append(eagle.vllm_config(tmp_path / name))
    target, drafter, other = (options.options_for(configs[0]), options.options_for(configs[0], "eagle_head"),
                              options.options_for(configs[1]))
    assert (target["model_name"], drafter["model_name"], other["model_name"]) == ("backbone", "eagle_head", "backbone")
    assert target["workspace_group"] == drafter["workspace_group"] != other["workspace_group"]
    (tmp_path / "plain").mkdir()
    plain = options.options_for(eagle.real.vllm_config(tmp_path / "plain"))
    assert "model_name" not in plain and "workspace_group" not in plain


class GpuRunner:
    """A stand-in for vLLM's `GPUModelRunner` (0.23's does not import without `llguidance`): its loaded
    target and drafter, and the two methods every forward starts from."""

    def __init__(self, pair):
        self.vllm_config, self.model = pair.target.config, pair.target.model
        self.drafter = types.SimpleNamespace(model=pair.drafter.model)
        self.forwards = 0

    def _dummy_run(self, num_tokens: int = 8) -> None:
        self.forwards += 1

    def execute_model(self) -> None:
        self.forwards += 1


def test_vllms_gpu_runner_compiles_its_drafter_before_its_first_forward(compiled, monkeypatch):
    """vLLM's mode 1 compiles the target only; resolving our backend by name (inside `load_model`) makes the
    GPU runner class compile the drafter before its first forward (the profiling run), once, with our
    backend: its graphs then replay. A runner not compiling with our backend is left alone."""
    import sys

    from ascend_compile.integrations.vllm import drafter as drafter_module
    from vllm.config import set_current_vllm_config

    made, make = compiled
    runner_cls = type("GPUModelRunner", (GpuRunner,), {})
    monkeypatch.setitem(sys.modules, drafter_module.RUNNER_MODULE, types.SimpleNamespace(GPUModelRunner=runner_cls))
    pairs = make(options={"capture_sizes": [4, 8, 16]}, compile=False)
    plain = runner_cls(pairs[1])  # the eager pair: compilation mode NONE
    with set_current_vllm_config(pairs[0].target.config):  # what `load_model` does under mode 1
        pairs[0].target.config.compilation_config.mode = 1
        pairs[0].target.config.compilation_config.backend = drafter_module.BACKEND_NAME
        pairs[0].target.model.compile(fullgraph=True, backend=integration.vllm_backend)
    runner = runner_cls(pairs[0])
    assert pairs[0].drafter.model._compiled_call_impl is None
    runner._dummy_run()
    runner.execute_model()
    plain._dummy_run()
    assert runner.forwards == 2 and pairs[0].drafter.model._compiled_call_impl is not None
    assert pairs[1].drafter.model._compiled_call_impl is None
    _run(pairs, SCHEDULE[:4])
    (target,), (drafter,) = made
    assert target.stats["replays"] > 0 and drafter.stats["replays"] > 0
