"""The generated code of routes: checks as Python expressions, and functions compiled from lines.

A route's gathering and checks are written as Python source over a call's positional arguments
`a`, keyword arguments `k` and the graph's arguments `A`, with the objects they compare against in
the route's namespace, and compiled once: a call then pays for the work and not for calling a
function per check.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: What an attribute that does not exist reads as.
MISSING = _Missing()


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: what it means when it fails, its expression, whether it runs before the graph's
    arguments are gathered, and an expression that says more when it fails."""

    description: str
    expr: str
    before_gather: bool = False
    detail_expr: str | None = None

    def holds(self, namespace: dict[str, Any], a: tuple, k: dict, graph_args: Sequence[Any]) -> bool:
        return bool(eval(self.expr, namespace, {"a": a, "k": k, "A": graph_args}))

    def detail(self, namespace: dict[str, Any], a: tuple, k: dict, graph_args: Sequence[Any]) -> str:
        if self.detail_expr is None:
            return ""
        return str(eval(self.detail_expr, namespace, {"a": a, "k": k, "A": graph_args}))


def evaluate(expr: str, namespace: dict[str, Any], a: tuple, k: dict) -> Any:
    """`expr` for one call."""
    return eval(expr, namespace, {"a": a, "k": k})


def compile_function(name: str, body: Sequence[str], namespace: dict[str, Any], params: str = "a, k") -> Any:
    """`def name(params):` with `body`, its globals `namespace`."""
    exec(compile("\n".join([f"def {name}({params}):", *body]), f"<ascend_compile route {name}>", "exec"), namespace)
    return namespace[name]
