"""FX -> FX passes: find attention, assign input roles, select kernels, plan and insert workspaces, dump."""
from .find_attention import find_attention, register_attention_op
from .roles import Role, assign_roles
from .select_kernels import KernelPolicy, select_kernels
from .workspaces import GraphKey, insert_workspaces, plan_workspaces

__all__ = [
    "find_attention", "register_attention_op", "Role", "assign_roles", "KernelPolicy",
    "select_kernels", "GraphKey", "insert_workspaces", "plan_workspaces",
]
