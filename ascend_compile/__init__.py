"""ascend-compile: a torch.compile backend that captures LLM inference steps into device graphs.

Public API: `backend`, `CompileConfig`, `register_attention_op`, and the op library `ops`.
"""
from . import ops
from .backend import backend
from .config import CompileConfig
from .passes.find_attention import register_attention_op

__all__ = ["backend", "CompileConfig", "register_attention_op", "ops"]
