"""A pytest plugin for the GPU check: each test's outcome and duration appended to a JSON file
(`$GPU_TESTS_JSON`) as soon as the test ends, so a run cut short still leaves every finished row.
Several pytest processes may share the file (a lock around each rewrite).

    GPU_TESTS_JSON=out/gpu_tests.json python -m pytest -p pytest_rows ...   # benchmarks/ on PYTHONPATH
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile

_PATH = os.environ.get("GPU_TESTS_JSON")


def _append(row: dict) -> None:
    if not _PATH:
        return
    # the lock lives outside the result folder, whose file count is limited
    with open(os.path.join(tempfile.gettempdir(), os.path.basename(_PATH) + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(_PATH) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {"rows": []}
        data["rows"].append(row)
        data["counts"] = {}
        for r in data["rows"]:
            data["counts"][r["outcome"]] = data["counts"].get(r["outcome"], 0) + 1
        tmp = f"{_PATH}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, _PATH)


def pytest_runtest_logreport(report) -> None:
    """One row per test: its call's outcome, or its setup's when that failed or skipped."""
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        row = {"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2)}
        if report.outcome == "failed":
            row["error"] = str(report.longrepr)[-1500:]
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            row["reason"] = report.longrepr[2]
        _append(row)
