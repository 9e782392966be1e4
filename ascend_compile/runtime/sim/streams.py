"""Streams, events and the device queue of the ACL-graph simulator.

The device runs work asynchronously from the host. Every launch — a graph replay, a task update, an
event record, wait or reset — is queued on a **stream**, an ordered queue, and the device drains the
queues when the host synchronizes (or when `SimDevice.advance` ticks its clock). Streams progress
independently of each other; only events order them. So, as on the device, the order in which the
host *issues* work on two streams says nothing about the order in which it *runs*.

Order is tracked with vector clocks: each stream counts the items it has run and knows how far it has
seen every other stream (through the events it waited on, and through the host, which has seen
everything run before its last synchronize). Item A happens before item B when B's clock has seen A.
From that order, whatever interleaving the drain picks:

- a task update and a kernel reading that task's arguments that no event chain orders is a race
  (`StreamRace`): on the device the kernel may read the old or the new arguments;
- a wait nothing queued can ever satisfy is a hang: the drain raises `ReplayError` naming the wait.

Source: ACL streams are queues the device runs asynchronously, ordered with one another only by
events (`aclrtRecordEvent` / `aclrtStreamWaitEvent`); torch_npu's `Stream` / `Event` expose them as
CUDA's. Races are the model's reading of that: two unordered items may run in either order.

Events are ACL's two kinds. An **external** event (`aclrtCreateEventExWithFlag(ACL_EVENT_EXTERNAL)`,
torch_npu's `ExternalEvent`) is a flag: `wait` blocks until it is set, `record` sets it, `reset`
clears it. An **ordinary** event (torch_npu's `Event`) marks a point of a stream: `wait` waits for the
last `record` issued before it, and waiting on a never-recorded event is a no-op.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional

from ...errors import ReplayError, StreamRace

#: A vector clock: stream id -> how many of that stream's items have been seen.
Clock = dict[int, int]


def join(into: Clock, other: Clock) -> None:
    """Merge `other` into `into`: afterwards `into` has seen everything either had seen."""
    for key, count in other.items():
        if into.get(key, 0) < count:
            into[key] = count


class SimStream:
    """An ordered queue of device work. `priority` decides which stream the drain serves first
    (lower first, as torch_npu's priority -1 outranks 0); order between streams comes from events."""

    def __init__(self, device: SimDevice, index: int, name: str, priority: int) -> None:
        self.device = device
        self.index = index
        self.name = name
        self.priority = priority
        self.queue: collections.deque[Work] = collections.deque()
        self.clock: Clock = {}

    @property
    def count(self) -> int:
        """How many items this stream has run."""
        return self.clock.get(self.index, 0)

    def _run_head(self) -> None:
        work = self.queue.popleft()
        join(self.clock, work.seen)
        self.clock[self.index] = self.count + 1
        work.run(self)

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, {len(self.queue)} queued)"


class Work:
    """One item of a stream's queue; `seen` is what the host had seen when it issued it."""

    __slots__ = ("label", "seen")

    def __init__(self, label: str) -> None:
        self.label = label
        self.seen: Clock = {}

    def ready(self) -> bool:
        """Whether the item can run now (a wait whose event is not set cannot)."""
        return True

    def run(self, stream: SimStream) -> None:
        """Execute the item on `stream` (its clock already counts the item)."""
        raise NotImplementedError

    def blocked(self) -> str:
        """Why the item cannot run, for the hang error."""
        return f"{self.label} cannot run"


class CallWork(Work):
    """Device work done by a function of the stream it runs on (kernels, updates, checks)."""

    __slots__ = ("fn",)

    def __init__(self, label: str, fn: Callable[[SimStream], None]) -> None:
        super().__init__(label)
        self.fn = fn

    def run(self, stream: SimStream) -> None:
        self.fn(stream)


class EventState:
    """The device side of one event: set or not, and the clock of the record that set it."""

    def __init__(self, name: str, external: bool) -> None:
        self.name = name
        self.external = external
        self.is_set = False
        self.clock: Clock = {}
        self.last_record: Optional[RecordWork] = None  # ordinary events: the last record issued


class RecordWork(Work):
    """`record(stream)`: set the event with everything the stream has seen so far.

    Recording an external event that is already set changes nothing a waiter can rely on: a wait
    may have passed on the earlier record, so it stays ordered only after that one."""

    __slots__ = ("event", "done", "clock")

    def __init__(self, label: str, event: EventState) -> None:
        super().__init__(label)
        self.event = event
        self.done = False
        self.clock: Clock = {}
        event.last_record = self  # issued now: the record later waits on this event wait for

    def run(self, stream: SimStream) -> None:
        self.clock = dict(stream.clock)
        if not (self.event.external and self.event.is_set):
            self.event.clock = self.clock
        self.event.is_set = True
        self.done = True


class ResetWork(Work):
    """`reset(stream)`: clear an external event, so its next wait needs a fresh record."""

    __slots__ = ("event",)

    def __init__(self, label: str, event: EventState) -> None:
        super().__init__(label)
        self.event = event

    def run(self, stream: SimStream) -> None:
        self.event.is_set = False


class WaitWork(Work):
    """`wait(stream)`: the stream stops here until the event allows it, then has seen its record."""

    __slots__ = ("event", "target")

    def __init__(self, label: str, event: EventState) -> None:
        super().__init__(label)
        self.event = event
        self.target = None if event.external else event.last_record

    def ready(self) -> bool:
        if self.event.external:
            return self.event.is_set
        return self.target is None or self.target.done

    def run(self, stream: SimStream) -> None:
        if self.event.external:
            join(stream.clock, self.event.clock)
        elif self.target is not None:
            join(stream.clock, self.target.clock)

    def blocked(self) -> str:
        return (
            f"{self.label}: waits on external event {self.event.name!r}, which was never recorded for this "
            f"replay and nothing queued records it (on a device the graph would hang here); record it after "
            f"the task update, on a stream the replay does not block, before synchronize()"
        )


class TaskAccess:
    """Who wrote (task updates) and read (kernel runs) one updatable task's arguments, to find
    accesses no event orders."""

    __slots__ = ("name", "write", "reads")

    def __init__(self, name: str) -> None:
        self.name = name
        self.write: Optional[tuple[SimStream, int, str]] = None
        self.reads: dict[SimStream, tuple[int, str]] = {}

    def read(self, stream: SimStream, label: str) -> None:
        """A kernel on `stream` reads the arguments: the last update must be ordered before it."""
        if self.write is not None:
            by, count, what = self.write
            if stream.clock.get(by.index, 0) < count:
                raise StreamRace(
                    f"{label}: reads the arguments of {self.name} while {what} on stream {by.name!r} is not "
                    f"ordered before it: on the device the kernel may run with the old or the new "
                    f"arguments. Record the task's event after the update and wait on it in the graph"
                )
        self.reads[stream] = (stream.count, label)

    def update(self, stream: SimStream, label: str) -> None:
        """A task update on `stream` rewrites the arguments: every earlier read must be done."""
        for by, (count, what) in self.reads.items():
            if stream.clock.get(by.index, 0) < count:
                raise StreamRace(
                    f"{label}: lands on {self.name} while a replay still reads its old arguments ({what}, on "
                    f"stream {by.name!r}, not ordered before the update): the device would run that kernel "
                    f"with the new step's arguments. Order the update after the replay (an event, or a "
                    f"synchronize)"
                )
        self.reads = {}
        self.write = (stream, stream.count, label)


class SimDevice:
    """The simulated device: its streams, the host's view of them, and the drain."""

    def __init__(self) -> None:
        self.streams: list[SimStream] = []
        self.host: Clock = {}

    def stream(self, name: str, priority: int = 0) -> SimStream:
        """A new stream; the drain serves streams by priority, then by creation."""
        stream = SimStream(self, len(self.streams), name, priority)
        self.streams.append(stream)
        self.streams.sort(key=lambda s: (s.priority, s.index))
        return stream

    def enqueue(self, stream: SimStream, work: Work) -> None:
        """Issue `work` on `stream` from the host."""
        work.seen = dict(self.host)
        stream.queue.append(work)

    @property
    def idle(self) -> bool:
        """Whether every queue is empty."""
        return not any(s.queue for s in self.streams)

    def drain(self) -> None:
        """Run everything queued (the host waits for the device). A hang (queued work nothing can
        unblock) or a race raises, and the queued work is dropped, as after a device reset."""
        try:
            self._run_until(lambda: self.idle)
        finally:
            for stream in self.streams:
                join(self.host, stream.clock)

    def run_stream(self, stream: SimStream) -> None:
        """Run until `stream`'s queue is empty (and whatever it waits for), the host not waiting for
        the other streams: what a device has done when work issued next on `stream` starts. A hang
        or a race raises and drops the queued work, as `drain`."""
        self._run_until(lambda: not stream.queue)

    def _run_until(self, done: Callable[[], bool]) -> None:
        """Passes until `done()`; a pass that runs nothing is a hang. Any error drops the queued work."""
        try:
            while not done():
                if not self._pass():
                    raise ReplayError("; ".join(s.queue[0].blocked() for s in self.streams if s.queue))
        except BaseException:
            self.clear()
            raise

    def advance(self, ticks: int) -> int:
        """Tick the device clock while the host goes on: up to `ticks` passes, stopping early when
        every queue is empty or blocked (the host may still issue what unblocks it); returns how
        many items ran. A race raises and drops the queued work."""
        ran = 0
        try:
            for _ in range(ticks):
                done = self._pass()
                if not done:
                    break
                ran += done
        except BaseException:
            self.clear()
            raise
        return ran

    def _pass(self) -> int:
        """One item from each stream whose head is ready, in drain order (interleaving the streams
        as finely as their items allow); how many ran."""
        ran = 0
        for stream in self.streams:
            if stream.queue and stream.queue[0].ready():
                stream._run_head()
                ran += 1
        return ran

    def clear(self) -> None:
        """Drop every queued item."""
        for stream in self.streams:
            stream.queue.clear()
