"""Events of the ACL-graph simulator: the host-side handle of an event.

An event action is a task of the graph when it is issued inside a capture (it becomes an item of
the replay's stream when the graph is launched), and an item of a stream when it is issued outside
one. The runtime makes that choice (the `issue` callable `SimEvent` is given); what an action does
on a stream (flags, stream points, hangs) is `streams.py`, the recorded task `tasks.EventTask`.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..base import ExternalEvent
from .streams import EventState, SimStream

#: Issues one action ("wait", "reset", "record") of an event, on a stream or None (the default one).
Issue = Callable[[EventState, str, Optional[SimStream]], None]


class SimEvent(ExternalEvent):
    """An event; `name` (the FX node's name) is what errors report.

    Inside capture each call records a task of the graph, which becomes an item of the replay's
    stream when the graph is launched; outside capture each call is issued on a stream (`record`:
    the update stream by default, `wait` and `reset`: the current stream). `external` events are
    flags (waited until set, reset to clear); ordinary ones mark a point of a stream (see
    `streams`). A replay whose wait nothing queued can satisfy raises `ReplayError` at the
    drain (the device hangs).
    """

    def __init__(self, name: str, external: bool, issue: Issue) -> None:
        self.name = name
        self.state = EventState(name, external)
        self._issue = issue

    @property
    def recorded(self) -> bool:
        """Whether the event is set on the device (recorded and not reset since)."""
        return self.state.is_set

    def wait(self, stream: Optional[SimStream] = None) -> None:
        """Inside capture: the graph waits here at replay until the event is recorded."""
        self._issue(self.state, "wait", stream)

    def reset(self, stream: Optional[SimStream] = None) -> None:
        """Inside capture: clear the event, so the next replay needs a fresh `record`."""
        if not self.state.external:
            raise ValueError(f"reset() of {self.name!r}: only external events are reset")
        self._issue(self.state, "reset", stream)

    def record(self, stream: Optional[SimStream] = None) -> None:
        """Outside capture (after a task update): set the event on `stream` when it gets there."""
        self._issue(self.state, "record", stream)

    def __repr__(self) -> str:
        return f"SimEvent({self.name!r}, recorded={self.recorded})"
