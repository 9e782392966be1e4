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

from ...config import DUMP_DIR_ENV, default_capture_sizes, default_piecewise_sizes

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


def options_for(vllm_config: Any, model_tag: str | None = None) -> dict[str, Any]:
    """The integrations' defaults, vLLM's config over them, then the environment's options over both.
    `model_tag`: a second model compiled beside the target (vLLM's tag for it, "eagle_head" for an
    EAGLE drafter) writes its dumps, if any, under `dump_dir/model_tag`, its plans apart from the target's."""
    options = {**DEFAULTS, **from_vllm_config(vllm_config), **from_environment()}
    dump_dir = options.get("dump_dir") or os.environ.get(DUMP_DIR_ENV)
    if model_tag is not None and dump_dir:
        options["dump_dir"] = os.path.join(dump_dir, model_tag)
    return {**options, **_piecewise_sizes(vllm_config, options)}


def current_vllm_config() -> Any:
    """The config vLLM has set as current (`set_current_vllm_config`: model loading, where its
    runner resolves `compilation_config.backend`), or None outside it or without vLLM."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()
