"""The torches ascend-compile is tested on, and which of its fast paths each one arms.

Users do not choose their torch: a serving runtime pins it (vLLM-Ascend 0.23: torch 2.10.0 with
torch_npu 2.10.0.post4; vLLM 0.23.0: 2.11.0; vLLM 0.33.0 and torch_npu 2.14.0: 2.14.0; an unpinned
install: the newest, 2.15.0). CI runs the whole suite on the floor and the ceiling (2.10, 2.15), vLLM's
own code on each vLLM's pin (2.11, 2.14.0) and the fast paths' tests on every one of them, plus the
development torch (2.13, `.ci/setup`). A torch outside that set is not refused (it may work), but the
import says, once, that it is untested.

The fast paths lean on dynamo's internals (its cache entries and guard tree, the bytecode it generates,
the wrapper it puts around a graph), which each torch release may change. Each is armed only on the
torches whose suite proved it (`FAST_PATHS`); elsewhere the same calls go through dynamo's own path,
which is slower but never wrong. `tests/test_torch_support.py` shows, on the torch it runs on, which
are armed and that each armed one equals eager.
"""
from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger("ascend_compile")

#: (major, minor) of every torch CI tests, and the stack that pins it.
TESTED: dict[tuple[int, int], str] = {
    (2, 10): "vLLM-Ascend 0.23 with torch_npu 2.10.0.post4 (whole suite)",
    (2, 11): "vLLM 0.23.0 (its real-code tests, the fast-path tests)",
    (2, 13): "development (the fast-path tests, the protocol mutants)",
    (2, 14): "vLLM 0.33.0 and torch_npu 2.14.0 (their real-code tests, the fast-path tests)",
    (2, 15): "the newest release, an unpinned install (whole suite)",
}

#: Fast path -> the torches it is armed on: each was proven by the suite there.
#: - "direct": `dispatch="direct"`, reading dynamo's cache entries, guard managers and generated code
#:   (`dispatch/`);
#: - "vllm_fast_path": the direct dispatcher put in front of vLLM's compiled module, standing in for the
#:   guards it reads from dynamo's guard tree (`integrations/vllm/fast_path.py`). Proven on vLLM's own code
#:   on torch 2.13 (vLLM 0.23) and 2.14 (vLLM 0.33). On torch 2.11 (vLLM 0.23's pin) dynamo keeps a
#:   NO_HASATTR guard on the `positions` argument that no check of the direct path stands in for (its
#:   guard policy refuses it: measured in `tests/test_vllm_real.py`), so it is not armed there, nor on 2.10
#:   (the same dynamo generation) or 2.15 (no vLLM release runs on it to prove it).
#: `frozen_parameters` reads no dynamo internal (it skips the runner's own parameter address checks) and is
#: armed on every torch.
FAST_PATHS: dict[str, frozenset[tuple[int, int]]] = {
    "direct": frozenset(TESTED),
    "vllm_fast_path": frozenset({(2, 13), (2, 14)}),
}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the installed torch's), e.g. (2, 10) of "2.10.0+cu128"."""
    match = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if match is None:
        raise ValueError(f"torch version {version or torch.__version__!r}: expected 'MAJOR.MINOR...'")
    return int(match.group(1)), int(match.group(2))


def tested_range() -> str:
    """The tested torches, as a user reads them."""
    return ", ".join(f"{major}.{minor}" for major, minor in sorted(TESTED))


def untested_warning(version: str | None = None) -> str | None:
    """The warning an untested torch gets (None on a tested one)."""
    release = torch_release(version)
    if release in TESTED:
        return None
    return (f"ascend_compile: torch {version or torch.__version__} is untested: ascend-compile is tested on torch "
            f"{tested_range()}; fast paths that read dynamo's internals ({', '.join(sorted(FAST_PATHS))}) are off "
            f"on it and calls go through dynamo's own path")


def fast_path_refusal(name: str, version: str | None = None) -> str | None:
    """Why the fast path `name` (a key of `FAST_PATHS`) is not armed on this torch, or None where it is."""
    release = torch_release(version)
    if release in FAST_PATHS[name]:
        return None
    proven = ", ".join(f"{major}.{minor}" for major, minor in sorted(FAST_PATHS[name]))
    return f"{name} is proven on torch {proven}, not on torch {version or torch.__version__}"


def armed_fast_paths(version: str | None = None) -> dict[str, bool]:
    """Each fast path and whether it is armed on this torch."""
    return {name: fast_path_refusal(name, version) is None for name in FAST_PATHS}


def warn_if_untested() -> None:
    """One WARNING, at import, where the installed torch is untested."""
    warning = untested_warning()
    if warning is not None:
        log.warning(warning)
