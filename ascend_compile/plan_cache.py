"""A warm start repeats nothing deterministic (issue 48, item 4): the answers of the compile's costly,
deterministic questions, persisted and asked again only where anything they depend on changed.

What a compile asks the device is deterministic for a given graph, options, software and device: the
kernel timings of `kernel_policy="auto"` (`ops/timing.py`), the workspace queries (`passes/probe.py`) and
the npu probes (`ops/npu/form_probe.py`, `ops/npu/band_probe.py`).
Each such question is marked `remembered(kind)`; while a compile runs with a plan directory
(`CompileConfig.plan_dir`, `using`), an answer found in its plan file is returned without asking, and
every answer asked is written there when the compile ends. The file is named by a digest of the key
(`key`): the dynamo graph's code and input shapes, the options, the torch, torch_npu and CANN versions,
the device (its runtime's description, a CUDA device's name and capability: vLLM's compile cache was
bitten by a key without the capability) and the rank. Any part changed names another file: recomputed,
never reused. Captured graphs themselves cannot be persisted (neither torch nor torch_npu can), and
dynamo's trace is not skipped: no torch we support offers a custom backend an AOT path (docs/).
The bottom of the package, like `errors.py` and `ledger.py`: every layer may mark its questions.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
from typing import Any, Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
_ACTIVE: list["PlanCache"] = []  # the plan of the compile under way, innermost last
#: Where CANN says its version (`<toolkit>/version.cfg`), the toolkit found by its set_env.sh's variable.
CANN_HOME_ENV = "ASCEND_HOME_PATH"


class PlanCache:
    """The persisted answers of one key's compile (`path`: its JSON file) and, for this compile, how
    many questions of each kind were answered from it (`reused`) and asked anew (`asked`)."""

    def __init__(self, directory: str, key: dict[str, Any]) -> None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = os.path.join(directory, f"plan-{digest}.json")
        self.key = key
        self.answers: dict[str, dict[str, Any]] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.answers = json.load(f)["answers"]
        self.reused: collections.Counter = collections.Counter()
        self.asked: collections.Counter = collections.Counter()

    def save(self) -> None:
        """Write the key and every answer (asked now or reused), whole or not at all."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": self.key, "answers": self.answers}, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def describe(self) -> dict[str, Any]:
        return {"file": self.path, "reused": dict(self.reused), "asked": dict(self.asked)}


@contextlib.contextmanager
def using(cache: PlanCache) -> Iterator[PlanCache]:
    """Answer the remembered questions of this block from `cache`, and save it when the block ends."""
    _ACTIVE.append(cache)
    try:
        yield cache
    finally:
        _ACTIVE.pop()
        cache.save()


def remembered(kind: str, question: Callable[..., Any] | None = None) -> Callable[[F], F]:
    """A decorator: under `using`, a call of the function is answered from the plan where the same
    question was asked before (`question(*args, **kwargs)`, by default the arguments; its repr must name
    what the answer depends on, never an address), else asked and kept. Its answer must be JSON (a number)."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _ACTIVE:
                return fn(*args, **kwargs)
            cache = _ACTIVE[-1]
            asked = repr(question(*args, **kwargs) if question is not None else (args, sorted(kwargs.items())))
            answers = cache.answers.setdefault(kind, {})
            if asked in answers:
                cache.reused[kind] += 1
                return answers[asked]
            cache.asked[kind] += 1
            answers[asked] = fn(*args, **kwargs)
            return answers[asked]

        return wrapper  # type: ignore[return-value]

    return decorate


def _version(dist: str) -> str:
    """An installed distribution's version, read from its metadata (torch_npu is never imported)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cann_version() -> str:
    """The CANN toolkit's version file's contents (`$ASCEND_HOME_PATH/version.cfg`), or "none"."""
    home = os.environ.get(CANN_HOME_ENV)
    path = os.path.join(home, "version.cfg") if home else None
    if path is None or not os.path.exists(path):
        return "none"
    with open(path) as f:
        return f.read().strip()


def key(graph: str, options: dict[str, Any], runtime: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A compile's key: its graph (`graph`: the dynamo graph's code and input shapes), options, runtime
    (its description), the versions of torch, torch_npu and CANN, the device and the rank."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return {"graph": hashlib.sha256(graph.encode()).hexdigest(), "options": options, "runtime": runtime,
            "torch": torch.__version__, "torch_npu": _version("torch-npu"), "cann": cann_version(),
            "device": device_name(device), "rank": rank}


def device_name(device: torch.device) -> str:
    """The device as the key names it: a CUDA device's name and capability too."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)} sm{torch.cuda.get_device_capability(device)}"
    return str(device)
