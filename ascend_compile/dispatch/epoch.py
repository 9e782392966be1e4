"""A process-wide count of assignments into modules' parameters, buffers and submodules.

The direct dispatcher gathers a model's parameters and buffers once, where dynamo walks the module
tree on every call. torch runs its global registration hooks whenever a parameter, buffer or
submodule is assigned (`module.weight = p`, `model.layers[3] = layer`, `register_buffer`,
`load_state_dict(assign=True)`, `ModuleList.append`): the count moves then, and a route armed at
another count sends its next call through dynamo's guards. Not seen: writes straight into a module's
`_parameters` / `_buffers` / `_modules` dicts and deletions (`del module.weight`), which run no hook.
Modules built while dynamo traces do not count. Any eager forward that builds a module (not this
package's example model; transformers' slices its layer list) moves it too, which costs the next
direct call a trip through dynamo.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.modules import module as nn_module


class _Count:
    """The count (an attribute, so that a generated check reads it without a call)."""

    value = 0


COUNT = _Count()
_lock = threading.Lock()
_installed = False


def _moved(*_: Any) -> None:
    # Not while dynamo traces: a module built inside a forward (transformers slices its ModuleList
    # every step) is no assignment to the model, and dynamo would replay the count's change after
    # the graph and guard on its value.
    if not torch.compiler.is_compiling():
        COUNT.value += 1


def install() -> None:
    """Register the three global hooks (once per process; each costs a call per registration)."""
    global _installed
    with _lock:
        if _installed:
            return
        nn_module.register_module_parameter_registration_hook(_moved)
        nn_module.register_module_buffer_registration_hook(_moved)
        nn_module.register_module_module_registration_hook(_moved)
        _installed = True


def current() -> int:
    """The count now."""
    return COUNT.value
