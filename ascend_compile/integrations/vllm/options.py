"""The backend's options for a vLLM engine: vLLM's own config first, `ASCEND_COMPILE_OPTIONS` over it.

vLLM knows the longest sequence it admits (`model_config.max_model_len`), the most tokens a step holds
(`scheduler_config.max_num_batched_tokens`: the largest piecewise size, `piecewise_sizes` up to it) and,
where the user set them, the batch sizes worth capturing (`compilation_config.cudagraph_capture_sizes`); the workspaces
sized for a different `max_model_len` than vLLM's would refuse requests vLLM admits. The block size
needs no option: each layer's KV cache, bound by vLLM, carries it. Two defaults differ from the
standalone backend's, since vLLM never moves or replaces a weight once loaded (weight reloading and
sleep mode write into the same parameters): `frozen_parameters=True` (parameters checked to be the
same objects, not their addresses, every step; KV caches stay address-checked) and
`dispatch="direct"` (steps skip dynamo's guards: `fast_path.py` says why that is sound). Options
given as JSON in the environment variable `ASCEND_COMPILE_OPTIONS` override both and what comes
from vLLM (`{"dispatch": "dynamo", "frozen_parameters": false}`: the standalone behaviour).
"""
from __future__ import annotations

import json
import os
from typing import Any

from ...config import default_capture_sizes, default_piecewise_sizes

OPTIONS_ENV = "ASCEND_COMPILE_OPTIONS"
#: What the integrations set before vLLM's config and the environment (see the module docstring).
DEFAULTS: dict[str, Any] = {"frozen_parameters": True, "dispatch": "direct"}


def from_vllm_config(vllm_config: Any) -> dict[str, Any]:
    """`max_model_len` and `capture_sizes` as vLLM's config has them (those it leaves unset are left out)."""
    options: dict[str, Any] = {}
    if vllm_config is None:
        return options
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "max_model_len", None):
        options["max_model_len"] = int(model.max_model_len)
    sizes = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None)
    if sizes:
        options["capture_sizes"] = sorted(int(s) for s in sizes)
    return options


def _piecewise_sizes(vllm_config: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`piecewise_sizes` up to vLLM's `max_num_batched_tokens` (no step holds more: piecewise graphs and
    the workspace slot are sized up to it, not beyond), from the capture sizes in force; unless set."""
    tokens = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    if not tokens or "piecewise_sizes" in options:
        return {}
    sizes = tuple(options.get("capture_sizes") or default_capture_sizes())
    return {"piecewise_sizes": list(default_piecewise_sizes(sizes, int(tokens)))}


def from_environment() -> dict[str, Any]:
    """The options in `ASCEND_COMPILE_OPTIONS` (JSON; empty when unset)."""
    return json.loads(os.environ.get(OPTIONS_ENV) or "{}")


#: vLLM's model tag for the main model (`vllm.compilation.backends.model_tag`'s default).
TARGET_TAG = "backbone"
#: The workspace group a target and its drafter join (`CompileConfig.workspace_group`, one slot for both),
#: named after their engine's speculative config.
SPECULATIVE_GROUP = "vllm-speculative-{:x}"


def has_drafter(vllm_config: Any) -> bool:
    """Whether vLLM loads a drafter model beside the target (a speculative config with a draft model:
    EAGLE, MTP, a draft LLM; not n-gram or suffix decoding)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return getattr(speculative, "draft_model_config", None) is not None


def _speculative(vllm_config: Any, model_tag: str | None) -> dict[str, Any]:
    """With a drafter beside the target, each model's name (`model_tag`: the drafter's, vLLM's
    "eagle_head"; else the target's, "backbone"), so that its dumps, plans and update tables are read
    apart (`dump_dir/<name>/graph_N`, `ascend-compile inspect`), and one workspace group for both: vLLM's
    runner runs the drafter after the target's step, on the same stream, never beside it. The group is
    the engine's: named after its speculative config (one object for both models: the proposer's config
    for the drafter is a shallow copy of the runner's), so two engines in one process never share one."""
    if model_tag is None and not has_drafter(vllm_config):
        return {}
    group = SPECULATIVE_GROUP.format(id(getattr(vllm_config, "speculative_config", None)))
    return {"model_name": model_tag or TARGET_TAG, "workspace_group": group}


def options_for(vllm_config: Any, model_tag: str | None = None) -> dict[str, Any]:
    """The integrations' defaults, vLLM's config over them, then the environment's options over both;
    `model_tag`: a model compiled beside the target (`_speculative`)."""
    options = {**DEFAULTS, **_speculative(vllm_config, model_tag), **from_vllm_config(vllm_config),
               **from_environment()}
    return {**options, **_piecewise_sizes(vllm_config, options)}


def current_vllm_config() -> Any:
    """The config vLLM has set as current (`set_current_vllm_config`: model loading, where its
    runner resolves `compilation_config.backend`), or None outside it or without vLLM."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()
