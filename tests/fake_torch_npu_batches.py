"""What the fake torch_npu asserts of a captured FIA task's batch at each task update (issue 47, item 3).

FIA's batch is the length of its lists, its block table has a row per entry (`_op_plugin_docs.py` L8223;
kernel source c29bc106 `prompt_flash_attention_tiling.cpp` L2262-2266), and a captured task is re-issued
at each update with the step's lists. Two hazards no document settles, so the fake refuses both:

- an update with more entries than the capture had: the task's tiling was made for the capture's batch
  (vLLM-Ascend captures its full graphs at the most requests they serve and only shrinks,
  `model_runner_v1.py` `_dummy_run` L3188-3191);
- an update passing another block-table tensor (another address, shape or strides) than the capture's:
  vLLM-Ascend found rebinding it corrupts sliding-window models' outputs and keeps the captured tensor
  (`attention_v1.py` L866-875).

They are checked when the call is issued (the update), on FIA v1 and on FIA v2's `learnable_sink` form,
the calls `ops/npu/kernels.py` binds; FIA v2's MLA form (`query_rope`) is bound elsewhere and not held to them.
"""
from __future__ import annotations

from typing import Any

#: The FIA calls held to these rules, and each one's KV-lengths argument.
KV_LENGTHS = {"npu_fused_infer_attention_score.out": "actual_seq_lengths_kv",
              "npu_fused_infer_attention_score_v2.out": "actual_seq_kvlen"}


def _table(block_table: Any) -> tuple:
    """What makes a block-table argument the same tensor to a task: its address, shape and strides."""
    return block_table.data_ptr(), tuple(block_table.shape), tuple(block_table.stride())


class TaskBatches:
    """Each capture group's FIA calls (entries, block table) and the check of each update against them."""

    def __init__(self) -> None:
        self.group: list[tuple[int, tuple]] | None = None  # the open capture group's calls
        self.updating: list[tuple[int, tuple]] | None = None  # the updated group's captured calls
        self.index = 0
        self.updates_checked = 0

    def group_begin(self) -> None:
        self.group = []

    def group_end(self) -> list[tuple[int, tuple]]:
        """The group's calls, kept by its handle."""
        calls, self.group = self.group or [], None
        return calls

    def update_begin(self, captured: list[tuple[int, tuple]]) -> None:
        self.updating, self.index = captured, 0

    def update_end(self) -> None:
        self.updating = None

    def issued(self, name: str, kwargs: dict[str, Any], capturing: bool) -> None:
        """A torch_npu call issued: recorded in a capture group, checked in an update."""
        if name not in KV_LENGTHS or kwargs.get("query_rope") is not None:
            return
        call = (len(kwargs[KV_LENGTHS[name]]), _table(kwargs["block_table"]))
        if capturing and self.group is not None:
            self.group.append(call)
        elif self.updating is not None:
            if self.index >= len(self.updating):
                raise RuntimeError(f"{name}: a task update issues more FIA calls than its group captured")
            (entries, table), self.index = self.updating[self.index], self.index + 1
            if call[0] > entries:
                raise RuntimeError(f"{name}: a task update with {call[0]} batch entries, more than the {entries} "
                                   f"its task was captured with (a capture must be at the most entries it serves)")
            if call[1] != table:
                raise RuntimeError(f"{name}: a task update passes another block table (address, shape, strides "
                                   f"{call[1]}) than its capture ({table}): keep the captured block table tensor")
            self.updates_checked += 1
