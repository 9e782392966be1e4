"""On the torch these tests run on: which fast paths are armed (`ascend_compile.torch_support`), that
each armed one serves calls and equals eager, that an unproven one is not armed (its calls go through
dynamo, still equal to eager), and the warning an untested torch gets. CI runs this file on every torch
users install (`.ci/run`): the whole suite on 2.10 and 2.15, this file beside vLLM's tests on 2.11 and
2.14.0, and on 2.13."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import ascend_compile
from ascend_compile import CompileConfig, backend, torch_support
from ascend_compile.dispatch import dynamo_code
from ascend_compile.integrations.vllm import fast_path
from ascend_compile.lowering import served
from examples.llama import LlamaConfig, PagedBatch, build

CFG = LlamaConfig(num_layers=2, num_blocks=256)
OPTIONS = dict(max_model_len=256, capture_sizes=(4, 8, 16), runtime="sim")
STEPS = [([37], None), ([5, 80, 17], None), ([45], [5]), ([30, 9, 100], [3, 1, 4]), ([12, 7], None)]


def test_the_installed_torch_is_one_ci_tests():
    """CI runs this file only on tested torches: a torch it lists must be one of `TESTED`, and one not
    listed must get the untested warning; here, which one this is, and what it arms."""
    release = torch_support.torch_release()
    armed = torch_support.armed_fast_paths()
    print(f"torch {torch.__version__}: tested={release in torch_support.TESTED}, armed={armed}")
    assert release in torch_support.TESTED, torch_support.untested_warning()
    assert armed == {name: release in proven for name, proven in torch_support.FAST_PATHS.items()}


@pytest.mark.parametrize("version, release", [("2.10.0+cu128", (2, 10)), ("2.15.0", (2, 15)), ("2.14.0a0+git1", (2, 14))])
def test_release_of_a_version_string(version, release):
    assert torch_support.torch_release(version) == release


def test_a_malformed_version_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'nightly'"):
        torch_support.torch_release("nightly")


@pytest.mark.parametrize("version", ["2.9.1", "2.12.0", "2.16.0.dev20261201", "3.0.0"])
def test_an_untested_torch_is_warned_naming_the_tested_range(version):
    warning = torch_support.untested_warning(version)
    assert f"torch {version} is untested" in warning and "2.10, 2.11, 2.13, 2.14, 2.15" in warning
    assert all(torch_support.fast_path_refusal(name, version) for name in torch_support.FAST_PATHS)


@pytest.mark.parametrize("version, vllm", [("2.10.0", False), ("2.11.0", False), ("2.13.0", True), ("2.14.0", True),
                                           ("2.14.1", True), ("2.15.0+cu132", False)])
def test_a_tested_torch_gets_no_warning_and_the_fast_paths_proven_on_it(version, vllm):
    assert torch_support.untested_warning(version) is None
    assert torch_support.armed_fast_paths(version) == {"direct": True, "vllm_fast_path": vllm}


def test_import_warns_once_on_an_untested_torch():
    """The import itself, in a fresh interpreter whose torch reports an untested version: one WARNING
    on the package's logger (printed by logging's last-resort handler, no configuration needed)."""
    code = "import torch; torch.__version__ = '2.9.1'; import ascend_compile"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.count("torch 2.9.1 is untested") == 1, out.stderr  # (a tested torch: no warning, above)


def _direct_steps(model):
    """`model` compiled with dispatch="direct" and stepped through STEPS: whether each call went
    through dynamo, and the largest difference from eager."""
    torch._dynamo.reset()
    reference = build(CFG)
    reference.load_state_dict(model.state_dict())
    fn = ascend_compile.compile(model, backend=backend(CompileConfig(**OPTIONS)), dispatch="direct")
    batch = PagedBatch(CFG, seed=3)
    through_dynamo, worst = [], 0.0
    for lens, query_lens in STEPS:
        step = batch.step(lens, query_lens)
        with served.probe() as calls:
            result = fn(**step)
        through_dynamo.append(bool(calls))
        worst = max(worst, (result - reference(**step)).abs().max().item())
    return through_dynamo, worst


@torch.no_grad()
def test_direct_dispatch_armed_here_serves_calls_equal_to_eager():
    if not torch_support.armed_fast_paths()["direct"]:
        pytest.skip(f"not armed on torch {torch.__version__} (test_an_unproven_direct_dispatch_...)")
    through_dynamo, worst = _direct_steps(build(CFG))
    assert through_dynamo == [True, False, False, False, False]
    assert worst < 1e-4


@torch.no_grad()
def test_an_unproven_direct_dispatch_is_not_armed_and_every_call_goes_through_dynamo(monkeypatch, caplog):
    monkeypatch.setitem(torch_support.FAST_PATHS, "direct", frozenset())
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        through_dynamo, worst = _direct_steps(build(CFG))
    assert through_dynamo == [True] * len(STEPS)
    assert worst < 1e-4
    assert f"direct is proven on torch , not on torch {torch.__version__}" in caplog.text


def test_an_unproven_vllm_fast_path_is_not_installed(monkeypatch, caplog):
    """The vLLM fast path asks before it looks for vLLM's compiled module (on vLLM's own code:
    tests/test_vllm_real.py, which runs on vLLM's pinned torches)."""
    monkeypatch.setitem(torch_support.FAST_PATHS, "vllm_fast_path", frozenset())
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert fast_path.install(object()) is None
    assert "vllm_fast_path is proven on torch" in caplog.text


def _code(source: str):
    namespace: dict = {}
    exec(compile(source, "<dynamo>", "exec"), namespace)
    return namespace["f"].__code__


GATED = '''
def f(x):
    enabled = __import_torch_dot_autograd_dot_profiler._is_profiler_enabled
    cm = None
    if enabled:
        cm = __import_torch_dot__dynamo_dot_utils.record_pregraph_bytecode_enter()
    size = __import_torch_dot__dynamo_dot_utils.call_size(x, 0)
    if cm is not None:
        __import_torch_dot__dynamo_dot_utils.record_pregraph_bytecode_exit(cm)
    out = __compiled_fn_1(x, size)
    return [out[0]]
'''


def test_torch_215s_profiler_gated_code_calls_only_the_graph():
    """torch 2.15's code for a frame branches around its profiler marks: the forward branches are
    allowed (each instruction either way is checked)."""
    assert dynamo_code.unsafe_instruction(_code(GATED), ["L['x']"], ()) is None


@pytest.mark.parametrize("edit, says", [
    (("if enabled:", "while enabled:"), "JUMP_BACKWARD"),  # a loop: no backward jump is allowed
    (("    out = __compiled_fn_1", "    x.seen = 1\n    out = __compiled_fn_1"), "STORE_ATTR"),
    (("_is_profiler_enabled", "_enable_profiler"), "LOAD_ATTR '_enable_profiler'"),
    (("__import_torch_dot_autograd_dot_profiler", "__import_os"), "LOAD_GLOBAL '__import_os'"),
])
def test_code_doing_more_than_the_gate_is_refused(edit, says):
    assert says in dynamo_code.unsafe_instruction(_code(GATED.replace(*edit)), ["L['x']"], ())
