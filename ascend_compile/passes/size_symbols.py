"""Size symbols of a graph: how each gets its value in a bucket graph, where a step's value is read
from, and size expressions evaluated at given values (on every step's hot path)."""
from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from typing import Any, Callable

import sympy


class SymbolKind(str, enum.Enum):
    """How a size symbol of the graph gets its value in a bucket graph."""

    TOKENS = "tokens"  # the step's token count (or sequence count): padded to the bucket
    BLOCKS = "blocks"  # block-table width: padded to max_model_len / block_size
    QUERY_START_LOC = "query_start_loc"  # padded to bucket + 1
    LAYOUT = "layout"  # a stride or storage offset of a copied input: the static buffer's own
    SPECIALIZED = "specialized"  # anything else: each distinct value gets its own capture


@dataclasses.dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's value is read from: an input's size / stride (at `dim`), storage offset,
    or the input itself (a SymInt)."""

    index: int
    attr: str  # "size", "stride", "offset" or "value"
    dim: int | None = None

    def read(self, value: Any) -> int:
        return self.reader(value)

    @functools.cached_property
    def reader(self) -> Callable[[Any], int]:
        """`read` as one C-level call (the runner reads every symbol on every step)."""
        if self.attr == "value":
            return int
        if self.attr == "offset":
            return operator.methodcaller("storage_offset")
        return operator.methodcaller(self.attr, self.dim)


def evaluate(expr: Any, values: dict[sympy.Symbol, int]) -> int:
    """An int or a size expression at the given symbol values."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Symbol):  # the common case, on every step's hot path
        return values[expr]
    return int(expr.xreplace(values))
