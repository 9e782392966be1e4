"""ascend-compile: a torch.compile backend that captures LLM inference steps into device graphs.

Public API: `backend`, `compile` (torch.compile with one backend compile for every step shape),
`trace_settings`, `CompileConfig`, `register_attention_op`, and the op library `ops`.
"""
from torch._logging._internal import register_log

from . import ops, torch_support
from .backend import backend
from .compile_once import compile, trace_settings
from .config import CompileConfig
from .passes.find_attention import register_attention_op

__all__ = ["backend", "compile", "trace_settings", "CompileConfig", "register_attention_op", "ops"]

# `TORCH_LOGS="ascend_compile"` (or "+ascend_compile" for debug) turns on this package's logs.
register_log("ascend_compile", "ascend_compile")
torch_support.warn_if_untested()
