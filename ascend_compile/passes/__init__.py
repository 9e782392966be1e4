"""FX -> FX passes: adapt attention, assign input roles, select kernels, plan and insert workspaces, dump."""
from .find_attention import adapt_attention, attention_nodes, register_attention_op
from .roles import Role, assign_roles
from .select_kernels import choose_kernels, select_kernels
from .workspaces import GraphKey, insert_workspaces, plan_workspaces

__all__ = [
    "adapt_attention", "attention_nodes", "register_attention_op", "Role", "assign_roles", "choose_kernels",
    "select_kernels", "GraphKey", "insert_workspaces", "plan_workspaces",
]
