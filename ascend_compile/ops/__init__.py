"""The op library: the `ascend` torch ops, their reference kernels and workspace sizes."""
from . import cuda, cuda_mla, library, mla
from .tiling import FIA, MLA, PA, AttentionShape, max_workspace, register_tiling, workspace_nbytes

__all__ = ["cuda", "cuda_mla", "library", "mla", "PA", "FIA", "MLA", "AttentionShape", "max_workspace",
           "register_tiling", "workspace_nbytes"]
