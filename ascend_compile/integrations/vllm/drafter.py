"""The drafter vLLM builds for speculative decoding, compiled by us beside the target.

vLLM's mode-1 compile (`GPUModelRunner.load_model`, 0.23 and 0.33) compiles the target only
(`self.model.compile(fullgraph=True, backend=...)`); the drafter it loaded just before
(`self.drafter.load_model(self.model)`: `EagleLlamaForCausalLM` and its kin, loaded under vLLM's model
tag "eagle_head") runs as written: its `support_torch_compile` decorator compiles nothing under mode 1
(`do_not_compile`). `compile_drafter` makes the same call on the drafter's model, with a backend of
its own: its own artifact, hence its own buckets, captured graphs and update table (its lengths are the
target's less the rejected tokens, plus one per draft step), named by vLLM's tag for it (`model_name`:
its plans under `dump_dir/eagle_head`, the target's under `dump_dir/backbone`), in one workspace group
with the target (one slot for both: `options.options_for`). Its attention
layers are its own (vLLM names them after the target's, `model.layers.<target layers + i>`), read
from the forward context the proposer sets for each draft step like the target's; the embedding and
LM head it shares with the target are parameters of both models, used in place by both artifacts.

Who calls it: vLLM-Ascend's plug-in (`ascend_plugin.compile_loaded`) after compiling the target; on
vLLM's GPU runner, where nothing of ours runs after `load_model`, `install` (run where vLLM's mode 1
resolves our backend by name, inside `load_model`, `__init__.__getattr__`) wraps the runner class's
`_dummy_run` and `execute_model`, the two ways to the model's first forward (the profiling run, the
warm-up, a step), to compile the drafter first, once (`ensure_drafter_compiled`).
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch

from .dynamo_backend import configured_backend
from .options import has_drafter

log = logging.getLogger("ascend_compile")

#: vLLM's model tag for an EAGLE / MTP drafter (`set_model_tag("eagle_head")` in the proposer's
#: `_get_model`, 0.23 and 0.33): the folder its dumps go to.
DRAFTER_TAG = "eagle_head"


def drafter_model(runner: Any) -> torch.nn.Module | None:
    """The drafter model a vLLM runner loaded (`runner.drafter.model`), or None: no speculative decoding,
    or a proposer without a model (n-gram, suffix decoding)."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def compile_drafter(model: torch.nn.Module, vllm_config: Any, model_tag: str = DRAFTER_TAG) -> None:
    """vLLM's mode-1 compile call on a drafter `model`, with its own backend (`configured_backend` for
    `vllm_config` under `model_tag`)."""
    model.compile(fullgraph=True, backend=configured_backend(vllm_config, model_tag))
    log.info("ascend_compile: the drafter %s is compiled with ascend_graph beside the target (model tag %r)",
             type(model).__name__, model_tag)


def compile_runner_drafter(runner: Any) -> bool:
    """`compile_drafter` on the drafter `runner` loaded, if any; whether there was one."""
    model = drafter_model(runner)
    if model is None:
        return False
    compile_drafter(model, runner.vllm_config)
    return True


#: vLLM's GPU runner (0.23, 0.33), imported by vLLM before it resolves our backend; the qualified name
#: its mode 1 resolves; the runner methods through which every forward starts.
RUNNER_MODULE, RUNNER_CLASS = "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"
BACKEND_NAME = "ascend_compile.integrations.vllm.vllm_backend"
FIRST_FORWARD = ("_dummy_run", "execute_model")
_WRAPPED = "_ascend_compile_drafter"


def ours(vllm_config: Any) -> bool:
    """Whether vLLM compiles its model with our backend (mode 1, `STOCK_TORCH_COMPILE`, naming it)."""
    compilation = vllm_config.compilation_config
    return int(compilation.mode) == 1 and compilation.backend == BACKEND_NAME


def ensure_drafter_compiled(runner: Any) -> None:
    """Compile the runner's drafter (`compile_runner_drafter`) unless it has none, it is compiled
    already (`Module.compile` sets `_compiled_call_impl`), or vLLM does not compile with our backend."""
    model = drafter_model(runner)
    if model is None or getattr(model, "_compiled_call_impl", None) is not None or not ours(runner.vllm_config):
        return
    compile_drafter(model, runner.vllm_config)


def wrap_runner(runner_cls: type) -> None:
    """Make `runner_cls`'s `FIRST_FORWARD` methods call `ensure_drafter_compiled` first (once per class)."""
    for name in FIRST_FORWARD:
        original = getattr(runner_cls, name)
        if getattr(original, _WRAPPED, False):
            continue

        @functools.wraps(original)
        def first_forward(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            ensure_drafter_compiled(self)
            return _original(self, *args, **kwargs)

        setattr(first_forward, _WRAPPED, True)
        setattr(runner_cls, name, first_forward)


def install(vllm_config: Any) -> None:
    """With a drafter in `vllm_config`, wrap vLLM's GPU runner class (`wrap_runner`), if imported."""
    if vllm_config is None or not has_drafter(vllm_config):
        return
    runner_cls = getattr(sys.modules.get(RUNNER_MODULE), RUNNER_CLASS, None)
    if runner_cls is None:
        log.info("ascend_compile: %s.%s not imported: the drafter is compiled where compile_runner_drafter "
                 "is called", RUNNER_MODULE, RUNNER_CLASS)
        return
    wrap_runner(runner_cls)
