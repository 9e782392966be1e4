"""Dumps: every stage of every bucket graph as readable Python, and one plan.json per compiled graph.

Written only when a dump directory is configured (`dump_dir` or env ASCEND_COMPILE_DUMP_DIR);
`ascend-compile inspect DIR` renders them.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any

from torch import fx

log = logging.getLogger("ascend_compile")

PLAN_FILE = "plan.json"
_counter = itertools.count()


def new_graph_dir(dump_dir: str) -> str:
    """A fresh directory for one compiled graph under `dump_dir` (graph_0, graph_1, ...)."""
    while True:
        path = os.path.join(dump_dir, f"graph_{next(_counter)}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue


def dump_graph(gm: fx.GraphModule, graph_dir: str | None, key: str, stage: str) -> str | None:
    """Write `gm` as readable Python to `graph_dir/key/stage.py`; no-op without a directory."""
    if graph_dir is None:
        return None
    folder = os.path.join(graph_dir, key)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{stage}.py")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False))
    log.debug("dumped %s", path)
    return path


def dump_plan(graph_dir: str | None, plan: dict[str, Any]) -> str | None:
    """Write (or rewrite) the graph's plan.json; no-op without a directory."""
    if graph_dir is None:
        return None
    path = os.path.join(graph_dir, PLAN_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plan, f, indent=2, default=str)
    os.replace(tmp, path)
    return path
