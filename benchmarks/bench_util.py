"""What the GPU benchmarks share: CUDA-event timing, the measured copy bandwidth of the roofline,
and result files rewritten after every row (so a run cut short still leaves every finished row).

Imported by the scripts beside it (`python benchmarks/NAME.py` puts this folder on `sys.path`).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import torch

#: Nominal HBM bandwidth (GB/s) of the devices the benchmarks are sized for, printed beside the
#: measured copy bandwidth the rooflines use.
NOMINAL_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def nominal_gbps(device: torch.device) -> float | None:
    """The nominal HBM bandwidth of a CUDA device from its name, or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in NOMINAL_GBPS.items() if k in name), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `iters` calls of `fn`, each timed alone (the device idle before it):
    with CUDA, between two CUDA events around the call, so the host work inside the call counts
    as far as the device waits for it; elsewhere, wall clock."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return times


def time_median(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of one call of `fn` (`time_calls`)."""
    return statistics.median(time_calls(fn, device, iters, warmup))


def time_throughput(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds per call of `fn` over `iters` calls back to back, between two CUDA events (wall
    clock elsewhere): a kernel's throughput, without a synchronisation per call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    start_s = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start_s) / iters


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (read + write counted): the
    roofline's bandwidth, measured in the same run as what it judges."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_throughput(lambda: dst.copy_(src), device, iters)


class Results:
    """A JSON result file rewritten (atomically) after every row: `{"info", "rows", **extra}`."""

    def __init__(self, path: str | None, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.write()

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        self.write()
        return row

    def set(self, key: str, value: Any) -> None:
        self.extra[key] = value
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"info": self.info, "rows": self.rows, **self.extra}, f, indent=1, default=str)
        os.replace(tmp, self.path)
