"""What a captured graph holds of its inputs, checked every step before it replays.

A captured graph reads its in-place inputs (weights, KV caches) at the addresses they had at
capture, and took its host scalars (0-d CPU tensors, e.g. the floats dynamo wraps) as values frozen
into its tasks. A step whose inputs moved, or whose scalars changed, must not replay it. Both checks
are one `map` over the gathered inputs (about 0.1 us an input); under plain
`torch.compile(dynamic=True)` every norm's epsilon is such a scalar, under `ascend_compile.compile`
(floats specialised) none is.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .inputs import gather


class CapturedInputs:
    """The addresses of the in-place inputs `checked` and the values of the host scalars `scalars`
    in the arguments a graph was captured with."""

    def __init__(self, args: Sequence[Any], checked: Sequence[int], scalars: Sequence[int]) -> None:
        self.addresses = {i: args[i].data_ptr() for i in checked if isinstance(args[i], torch.Tensor)}
        self.scalars = {i: args[i].item() for i in scalars}
        self._pointers = (gather(list(self.addresses)), list(self.addresses.values()))
        self._values = (gather(list(self.scalars)), list(self.scalars.values()))

    def changed(self, args: Sequence[Any], names: dict[int, str]) -> list[str]:
        """Names of the in-place inputs at another address, and of the scalars of another value,
        than at capture."""
        (pick, pointers), (pick_scalars, values) = self._pointers, self._values
        moved = []
        if list(map(torch.Tensor.data_ptr, pick(args))) != pointers:
            moved = [names[i] for i, ptr in self.addresses.items() if args[i].data_ptr() != ptr]
        if list(map(torch.Tensor.item, pick_scalars(args))) != values:
            moved += [names[i] for i, v in self.scalars.items() if args[i].item() != v]
        return moved
