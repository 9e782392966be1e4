"""Dumps: every stage of every graph as readable Python, and one plan.json per compiled graph.

Files are written only when a dump directory is configured (`dump_dir` or env
ASCEND_COMPILE_DUMP_DIR); `ascend-compile inspect DIR` renders them. The same graphs and plans go to
torch's structured trace as artifacts named `ascend_compile_*` (`TORCH_TRACE=dir`, read with
`tlparse`), beside dynamo's and inductor's graphs of the same compile.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any, Callable

import torch
from torch import fx
from torch._logging import trace_structured

log = logging.getLogger("ascend_compile")

PLAN_FILE = "plan.json"
_counter = itertools.count()


def new_graph_dir(dump_dir: str, model: str | None = None) -> str:
    """A fresh directory for one compiled graph under `dump_dir` (graph_0, graph_1, ...), in a folder
    of its own for a named `model` (`dump_dir/<model>/graph_N`: two models' dumps kept apart)."""
    while True:
        path = os.path.join(dump_dir, *([model] if model else []), f"graph_{next(_counter)}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue


def _tracing() -> bool:
    """Whether torch's structured trace goes to a file (`TORCH_TRACE`): only then are payloads built.

    Torch always installs its lazy trace handler; it has a directory only under `TORCH_TRACE`.
    """
    handler = getattr(torch._logging._internal, "LOG_TRACE_HANDLER", None)
    return handler is not None and getattr(handler, "root_dir", None) is not None


def _trace(name: str, payload: Any, encoding: str) -> None:
    if not _tracing():
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload,
                     expect_trace_id=False)


def dump_graph(gm: fx.GraphModule, graph_dir: str | None, key: str, stage: str) -> str | None:
    """Write `gm` as readable Python to `graph_dir/key/stage.py` (with a directory) and to the trace."""
    _trace(f"ascend_compile_{key}_{stage}", lambda: gm.print_readable(print_output=False), "string")
    if graph_dir is None:
        return None
    folder = os.path.join(graph_dir, key)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{stage}.py")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False))
    log.debug("dumped %s", path)
    return path


def dump_plan(graph_dir: str | None, plan_fn: Callable[[], dict[str, Any]]) -> str | None:
    """Write (or rewrite) the graph's plan.json (with a directory) and trace it; `plan_fn` builds
    the plan, and is called only when it goes somewhere (a plan describes every graph key, and is
    rewritten after each capture)."""
    if graph_dir is None and not _tracing():
        return None
    plan = plan_fn()
    _trace("ascend_compile_plan", lambda: json.dumps(plan, default=str), "json")
    if graph_dir is None:
        return None
    path = os.path.join(graph_dir, PLAN_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plan, f, indent=2, default=str)
    os.replace(tmp, path)
    return path
