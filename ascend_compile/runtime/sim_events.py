"""Events of the ACL-graph simulator (`runtime/sim.py`): the host-side handle of an event.

An event action is a task of the graph when it is issued inside a capture (it becomes an item of
the replay's stream when the graph is launched), and an item of a stream when it is issued outside
one. `SimEvent` makes that choice; what an action does on a stream (flags, stream points, hangs) is
`sim_streams.py`, the recorded task `sim_tasks._EventTask`. Its own module so that the runtime in
`sim.py` only creates events and the rules for issuing them sit next to the event itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .base import ExternalEvent
from .sim_streams import EventState, SimStream
from .sim_tasks import _EventTask

if TYPE_CHECKING:
    from .sim import SimRuntime


class SimEvent(ExternalEvent):
    """An event; `name` (the FX node's name) is what errors report.

    Inside capture each call records a task of the graph, which becomes an item of the replay's
    stream when the graph is launched; outside capture each call is issued on a stream (`record`:
    the update stream by default, `wait` and `reset`: the current stream). `external` events are
    flags (waited until set, reset to clear); ordinary ones mark a point of a stream (see
    `sim_streams`). A replay whose wait nothing queued can satisfy raises `ReplayError` at the
    drain (the device hangs).
    """

    def __init__(self, runtime: SimRuntime, name: str, external: bool = True) -> None:
        self._runtime = runtime
        self.name = name
        self.state = EventState(name, external)

    @property
    def recorded(self) -> bool:
        """Whether the event is set on the device (recorded and not reset since)."""
        return self.state.is_set

    def wait(self, stream: Optional[SimStream] = None) -> None:
        """Inside capture: the graph waits here at replay until the event is recorded."""
        self._issue("wait", stream)

    def reset(self, stream: Optional[SimStream] = None) -> None:
        """Inside capture: clear the event, so the next replay needs a fresh `record`."""
        if not self.state.external:
            raise ValueError(f"reset() of {self.name!r}: only external events are reset")
        self._issue("reset", stream)

    def record(self, stream: Optional[SimStream] = None) -> None:
        """Outside capture (after a task update): set the event on `stream` when it gets there."""
        self._issue("record", stream)

    def _issue(self, action: str, stream: Optional[SimStream]) -> None:
        """Inside capture: a task of the graph. Outside: issued on `stream` (a record by default on
        the update stream, where the updates it follows are)."""
        rt = self._runtime
        graph = rt._capturing
        if graph is not None:
            graph._tasks.append(_EventTask(self.state, action, f"{graph.name} task {len(graph._tasks)}"))
            return
        default = rt.update_stream if action == "record" else rt.current_stream
        task = _EventTask(self.state, action, f"{action}() of {self.name!r} outside capture")
        rt.device_queue.enqueue(stream or default, task.work())

    def __repr__(self) -> str:
        return f"SimEvent({self.name!r}, recorded={self.recorded})"
