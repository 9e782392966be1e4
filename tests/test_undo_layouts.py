"""The undo log (`lowering/undo.py`) over vLLM's cache layouts: what a step's cache writes may overwrite
is saved by rows before it and put back exactly, the rows it does not write left alone; a layer's key
and value halves of one allocation (vLLM 0.23's `[num_blocks, 2, ...]`, vLLM 0.33's page) are read in
one gather."""
from __future__ import annotations

import pytest
import torch

from ascend_compile.lowering.undo import UndoPlan

NB, BS, H, D = 8, 4, 2, 3


def vllm_023() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache = torch.randn(NB, 2, BS, H, D)
    return cache, cache[:, 0], cache[:, 1]


def vllm_033() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    page = torch.randn(NB, H, BS, 2 * D)
    key, value = page.transpose(1, 2).split(D, dim=-1)
    return page, key, value


def separate() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key, value = torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, D)
    return key, key, value


@pytest.mark.parametrize("layout", [vllm_023, vllm_033, separate], ids=["vllm-0.23", "vllm-0.33", "separate"])
def test_saved_rows_are_put_back_exactly_and_only_they(layout):
    torch.manual_seed(0)
    whole, key, value = layout()
    other_whole, other_key, other_value = layout()  # a second layer, sharing the slots
    slots = torch.tensor([5, 0, 31, 17, 17])  # a duplicate, as padding repeats a slot
    args = [key, value, other_key, other_value, slots]
    plan = UndoPlan(rows=((0, 4), (1, 4), (2, 4), (3, 4)), whole=())
    tensors = (whole, other_whole) if whole is not key else (key, value, other_key, other_value)
    before = [t.clone() for t in tensors]
    undo = plan.save(args, rows_wanted=True)
    for t in tensors:
        t.fill_(7.0)  # the step wrote everything (more than its slots)
    undo.restore()
    for cache, original in zip(args[:4], _views(before, layout), strict=True):
        rows = cache.flatten(0, 1) if cache.is_contiguous() else cache.reshape(NB * BS, H, D)
        want = original.reshape(NB * BS, H, D)
        for slot in range(NB * BS):
            if slot in slots.tolist():
                assert torch.equal(rows[slot], want[slot]), f"slot {slot} not put back"
            else:
                assert torch.equal(rows[slot], torch.full_like(rows[slot], 7.0)), f"slot {slot} written by the undo"


def _views(before: list[torch.Tensor], layout) -> list[torch.Tensor]:
    """The four caches' views of the saved copies, as `layout` made them."""
    if layout is vllm_023:
        return [before[0][:, 0], before[0][:, 1], before[1][:, 0], before[1][:, 1]]
    if layout is vllm_033:
        return [*before[0].transpose(1, 2).split(D, dim=-1), *before[1].transpose(1, 2).split(D, dim=-1)]
    return before
