"""Seconds of graph steps per phase, counted at what a step can afford on its path."""
from __future__ import annotations

import collections


class PhaseSeconds(collections.Counter):
    """`copy_in`, `launch_and_updates` and `synchronize` (the device's work, or on the simulator its
    execution) and `host` (the rest of the runner's step). `device` is the sum of the first three: the
    runner reads it before and after a step to take them out of the step's host time, where a
    `Counter.total()` on each side cost more than the step's own counting (about 1 us of a 50 us step)."""

    device = 0.0

    def replayed(self, start: float, copied: float, launched: float, end: float) -> None:
        """One replay's phases (`time.perf_counter` readings): copy in from `start` to `copied`, launch and
        task updates to `launched`, synchronize to `end`."""
        self["copy_in"] += copied - start
        self["launch_and_updates"] += launched - copied
        self["synchronize"] += end - launched
        self.device += end - start
