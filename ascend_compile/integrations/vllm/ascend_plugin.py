"""vLLM-Ascend's plug-in: compile the loaded model with `ascend_graph`, opted in by one setting.

On vLLM-Ascend no configuration reaches a backend of ours: `NPUPlatform.check_and_update_config`
turns every compilation mode but NONE / VLLM_COMPILE into NONE (vllm_ascend/platform.py), and
`NPUModelRunner.load_model` never calls `model.compile` (only vLLM's `GPUModelRunner.load_model` does,
under mode 1). So this plug-in, a `vllm.general_plugins` entry point (pyproject.toml) that vLLM
loads in every process, wraps `NPUModelRunner.load_model`: once the model is loaded it makes the
mode-1 call vLLM's GPU runner makes, `model.compile(fullgraph=True, backend=...)`, with the backend
configured from the runner's `vllm_config` (`options.py`). The platform's mode reset no longer
matters: the compile does not depend on the compilation mode.

Opt in with `ASCEND_COMPILE_VLLM_ASCEND=1` and run vLLM-Ascend eagerly (`enforce_eager=True`:
compilation mode NONE, `cudagraph_mode` NONE), since this backend captures the graphs; with
vLLM-Ascend's own ACL graphs or its own compile on, the plug-in stays out of the way and says so.
Every start-up logs one line on the `ascend_compile` logger: in use, or why not.

Read against: vLLM-Ascend 0.23.0.post1 (its `releases/v0.23.0` branch, `NPUPlatform.check_and_update_config`
in `vllm_ascend/platform.py`, `NPUModelRunner.load_model` in `vllm_ascend/worker/model_runner_v1.py`) on
vLLM 0.23.0 (`GPUModelRunner.load_model`'s mode-1 call, `CompilationConfig.mode` / `cudagraph_mode`).
That vLLM-Ascend declares torch 2.10.0 / torch_npu 2.10.0.post4 (its versioning policy); this plug-in
calls no torch_npu API itself; the `npu` runtime it compiles for binds only APIs that torch_npu 2.10.0.post4
and 2.14.0 both offer with the same schemas (both wheels read: docs/ascend.md), and the whole suite runs on
torch 2.10.0 in CI.
No vLLM-Ascend for vLLM 0.33 existed when it was written; the backend it installs refuses a vLLM other
than 0.23 / 0.33 at start-up (`releases.SUPPORTED`). Tested on
vLLM's own code with a stand-in `NPUModelRunner` (vLLM-Ascend's does not import on a CPU: docs/vllm.md).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

from .options import options_for

log = logging.getLogger("ascend_compile")

ENV = "ASCEND_COMPILE_VLLM_ASCEND"
RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
RUNNER_CLASS = "NPUModelRunner"
_WRAPPED = "_ascend_compile_wrapped"


def register() -> None:
    """The entry point: wrap `NPUModelRunner.load_model` when opted in and vLLM-Ascend imports."""
    if os.environ.get(ENV) != "1":
        log.info("ascend_compile: ascend_graph not in use for vLLM-Ascend: %s is not 1", ENV)
        return
    try:
        runner_cls = getattr(importlib.import_module(RUNNER_MODULE), RUNNER_CLASS)
    except Exception as err:  # noqa: BLE001 - any import failure: not vLLM-Ascend, or a broken install
        log.warning("ascend_compile: ascend_graph not in use: %s=1 but %s.%s does not import (%s: %s)",
                    ENV, RUNNER_MODULE, RUNNER_CLASS, type(err).__name__, err)
        return
    wrap_load_model(runner_cls)


def wrap_load_model(runner_cls: type) -> None:
    """Make `runner_cls.load_model` compile the model it loads (`compile_loaded`); once per class."""
    original = runner_cls.load_model
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        compile_loaded(self)
        return result

    setattr(load_model, _WRAPPED, True)
    runner_cls.load_model = load_model


def why_not(vllm_config: Any) -> str | None:
    """Why the loaded model is not to be compiled by us (None: it is): vLLM-Ascend's own ACL graphs
    or its own compile would capture or compile around ours."""
    compilation = vllm_config.compilation_config
    graphs = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    if graphs != "NONE":
        return (f"vLLM-Ascend captures ACL graphs itself (compilation_config.cudagraph_mode={graphs}); "
                f"run it eagerly (enforce_eager=True) so that ascend_graph captures them")
    mode = getattr(compilation.mode, "name", str(compilation.mode))
    if mode not in ("NONE", "0"):
        return (f"vLLM-Ascend compiles the model itself (compilation_config.mode={mode}); run it eagerly "
                f"(enforce_eager=True) so that ascend_graph compiles it")
    return None


def compile_loaded(runner: Any) -> None:
    """vLLM's mode-1 compile call on the runner's loaded model and on its drafter, if it has one
    (`drafter.py`), or a log line saying why not."""
    from .drafter import compile_runner_drafter
    from .dynamo_backend import configured_backend

    config = runner.vllm_config
    reason = why_not(config)
    if reason is not None:
        log.warning("ascend_compile: ascend_graph not in use: %s", reason)
        return
    runner.model.compile(fullgraph=True, backend=configured_backend(config))
    compile_runner_drafter(runner)
    log.info("ascend_compile: ascend_graph in use for vLLM-Ascend's %s: the model is compiled with it "
             "(options %s)", type(runner).__name__, options_for(config))
