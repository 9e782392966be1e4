"""A step's outputs: the graph's (static, padded) outputs cut to the step's sizes, cloned unless
asked not to, and the outputs that are views of the caller's own tensors returned as those views."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..passes.size_symbols import evaluate


def narrowed_outputs(outputs: Any, shapes: Sequence[Any], symbols: dict, skip: Sequence[int]) -> list:
    """The graph's outputs cut to the step's sizes, but those at the positions in `skip`."""
    result = []
    for position, (out, shape) in enumerate(zip(outputs, shapes)):
        if position not in skip and isinstance(out, torch.Tensor) and shape is not None:
            for dim, n in enumerate(evaluate(d, symbols) for d in shape):
                if out.shape[dim] != n:
                    out = out.narrow(dim, 0, n)
        result.append(out)
    return result


def returned_outputs(narrowed: Sequence[Any], clone: bool, aliased: dict[int, torch.Tensor]) -> tuple:
    """The step's outputs: the graph's, narrowed (cloned unless not asked), and the outputs that are
    views of the caller's own tensors as those views (`aliased`; their size may be none of the
    inputs' symbols, e.g. a slice whose length the trace could not decide)."""
    return tuple(aliased[i] if i in aliased else out.clone() if clone and isinstance(out, torch.Tensor) else out
                 for i, out in enumerate(narrowed))
