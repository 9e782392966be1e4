"""The op library: the `ascend` torch ops, their reference kernels and workspace sizes."""
from . import cuda, library
from .tiling import FIA, PA, AttentionShape, max_workspace, register_tiling, workspace_nbytes

__all__ = ["cuda", "library", "PA", "FIA", "AttentionShape", "max_workspace", "register_tiling", "workspace_nbytes"]
