"""Which mutants a change can have let through: those whose files it touches, for `tools/mutants.py
--changed-since BASE` (CI gives it `.ci/mutants-base`, the last commit the whole set was run on, all caught).

A mutant's verdict at BASE stands unless one of these changed between BASE and the working tree (the
rules, each naming what it stands in for):

- its own definition (new, or any field differs from BASE's `MUTANTS`): the bug put back, or the tests
  that must catch it, are not the ones run at BASE;
- a file in the directory of the file it edits: the module itself, or a sibling it works with (a pass and
  the passes beside it, a runtime and its simulator's modules);
- a test file it runs: the test that catches it may have been weakened or removed;
- what every test stands on: any file under `tests/` that is not a `test_*.py` (conftest, helpers, fakes,
  stand-ins, fixtures; not `tests/hypothesis-db/`, the examples every run of the tester saves), `examples/` (the models the tests build), the pins (`pyproject.toml`'s
  requirements, `.ci/setup`, `.ci/*venv`, `.ci/*requirements.txt`): then every mutant is run.

A BASE that is not a commit of this history runs every mutant. What this does not see: a change to a
module in another directory that routes the tests around a mutant's edit (a mutant of `ops/` made
unreachable by a change in `lowering/`); the whole set, `python tools/mutants.py`, run before moving
`.ci/mutants-base` forward, is what sees it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Sequence

SHARED_PINS = (".ci/setup",)
HYPOTHESIS_DB = "tests/hypothesis-db/"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def changed_files(root: Path, base: str) -> set[str] | None:
    """The paths changed between `base` and the working tree (both sides of a rename, untracked files
    included); None when `base` is not a commit of this repository's history."""
    try:
        _git(root, "merge-base", "--is-ancestor", base, "HEAD")
    except subprocess.CalledProcessError:
        return None
    diff = _git(root, "diff", "--no-renames", "--name-only", base, "--").split()
    untracked = _git(root, "ls-files", "--others", "--exclude-standard").split()
    return set(diff) | set(untracked)


def _pins(root: Path, rev: str | None) -> Any:
    """`pyproject.toml`'s requirements (Python, dependencies, extras) at `rev` (None: the working tree)."""
    text = (root / "pyproject.toml").read_text() if rev is None else _git(root, "show", f"{rev}:pyproject.toml")
    project = tomllib.loads(text).get("project", {})
    return [project.get(k) for k in ("requires-python", "dependencies", "optional-dependencies")]


def _is_shared(path: str, root: Path, base: str) -> bool:
    name = Path(path).name
    if path.startswith(HYPOTHESIS_DB):  # examples a run of the tester saved (each run adds some), not code
        return False
    if path.startswith("tests/"):
        return not (path.count("/") == 1 and name.startswith("test_") and name.endswith(".py"))
    if path == "pyproject.toml":  # its pins, not its entry points or tool settings
        return _pins(root, base) != _pins(root, None)
    if path.startswith("examples/") or path in SHARED_PINS:
        return True
    return path.startswith(".ci/") and (name.endswith("venv") or name.endswith("requirements.txt"))


def load_mutants(source: str) -> tuple[Any, ...]:
    """`MUTANTS` of a `tools/mutants.py` given as its source text (another commit's, say)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("_mutants_elsewhere", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
        Path(f.name).unlink()
    return module.MUTANTS


def _base_definitions(root: Path, base: str) -> set[tuple[Any, ...]]:
    """Every mutant of `tools/mutants.py` as it was at `base`, as a tuple of its fields."""
    try:
        source = _git(root, "show", f"{base}:tools/mutants.py")
    except subprocess.CalledProcessError:  # no mutants at base: every one is new
        return set()
    return {dataclasses.astuple(m) for m in load_mutants(source)}


def select(mutants: Sequence[Any], root: Path, base: str) -> tuple[list[Any], str]:
    """(the mutants to run, one line saying why): those the change since `base` touches (module docstring)."""
    changed = changed_files(root, base)
    if changed is None:
        return list(mutants), f"{base!r} is not a commit of this history: every mutant"
    shared = sorted(p for p in changed if _is_shared(p, root, base))
    if shared:
        return list(mutants), f"changed since {base[:12]}: {', '.join(shared[:3])}{' ...' if len(shared) > 3 else ''}" \
                              f" (what every test stands on): every mutant"
    known = _base_definitions(root, base)
    dirs = {str(Path(p).parent) for p in changed}
    chosen, why = [], {"new or changed": 0, "its directory": 0, "its tests": 0}
    for m in mutants:
        if dataclasses.astuple(m) not in known:
            why["new or changed"] += 1
        elif str(Path(m.path).parent) in dirs:
            why["its directory"] += 1
        elif any(t.split("::")[0] in changed for t in m.tests):
            why["its tests"] += 1
        else:
            continue
        chosen.append(m)
    reasons = ", ".join(f"{n} {k}" for k, n in why.items() if n)
    return chosen, (f"changed since {base[:12]}: {len(chosen)} of {len(mutants)} mutants"
                    f"{' (' + reasons + ')' if reasons else ''}; the others' verdicts at {base[:12]} stand")
