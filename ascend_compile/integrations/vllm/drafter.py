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

vLLM-Ascend's plug-in (`ascend_plugin.compile_loaded`) calls `compile_runner_drafter` after compiling
the target; a runner vLLM drives itself under mode 1 calls it after `load_model`.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from .dynamo_backend import configured_backend

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
