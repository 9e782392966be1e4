"""A replay's static inputs on the ACL-graph simulator.

`SimGraph.replay` only queues the graph: on the device it runs later, and reads its static inputs
(general-pool memory it reads and never writes) as they are *then*. A host write into one between
`replay()` and the replay running is a bug the eager answer hides. (Source: a replay is launched on
a stream and runs when the device reaches it, `NPUGraph.replay` returning at once; torch_npu's
graph API is asynchronous like every stream launch.) So a launch snapshots those
inputs (`snapshot`) and the first item of the replay checks them (`check_unchanged`). Its own
module because it is the one check of host/device ordering on memory rather than on tasks.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import ReplayError
from .pool import Region
from .tasks import OpTask, Task


def static_inputs(tasks: list[Task]) -> dict[Region, str]:
    """General-pool memory `tasks` read and never write (a graph's static inputs), each with the
    first task reading it."""
    written: set[Region] = set()
    read: dict[Region, str] = {}
    for task in tasks:
        if isinstance(task, OpTask):
            written.update(r.region() for r in task.writes())
            for ref in task.reads():
                read.setdefault(ref.region(), task.label)
    return {k: v for k, v in read.items() if k not in written and k[0].pool.name == "general"}


def snapshot(inputs: dict[Region, str]) -> list[tuple[Region, str, torch.Tensor]]:
    """A copy of each input's bytes as they are now, at launch."""
    with _disable_current_modes():
        return [(key, label, key[0].data[key[1] : key[1] + key[2]].clone()) for key, label in inputs.items()]


def check_unchanged(graph: str, saved: list[tuple[Region, str, torch.Tensor]]) -> None:
    """At the start of the replay of `graph`: its static inputs still hold what they held at launch."""
    for (segment, offset, size), label, before in saved:
        if not torch.equal(segment.data[offset : offset + size], before):
            raise ReplayError(
                f"{label}: reads {segment.pool.name} memory #{segment.index}+{offset:#x} ({size} bytes), which "
                f"the host wrote after replay() of {graph} and before the replay ran: on the device the "
                f"replay would read the new values. Write a static input before replay() or after "
                f"synchronize()"
            )
