"""Mutants written by a tool: mutmut 3 over the modules of `tools/mutation/modules.toml`, each survivor
either killed by a test or listed as equivalent, with its reason, in `tools/mutation/equivalents/` (a file per module).

    python tools/mutation_ci.py [--modules PATH ...] [--changed-since BASE] [--max-children N]
                                [--workdir DIR] [--json FILE] [--no-run] [--stale] [--again] [--record]

Why a driver and not a bare `mutmut run`: mutmut's stats phase runs every test it is given once, and its
test selection is one setting for the whole run; the suite takes 15 minutes on two cores. Here each
module names the test files that own its behaviour, modules naming the same files are mutated in one
run, and each run is a scratch copy of the working tree (`git ls-files`: tracked and untracked, not
ignored) whose `pyproject.toml` gets the group's `[tool.mutmut]` (the repository's own table, plus
`only_mutate` and `pytest_add_cli_args_test_selection`). mutmut then runs, for each mutant, only the
tests of the group that called the mutated function (its trampolines record which), stopping at the
first failure.

A survivor (mutmut's "survived", or "no tests": no test of the group reaches the function) is
**listed** when an entry of the equivalents files has its module, its function and the lines its diff
removes and adds (whitespace-stripped; and which of the function's survivors making that same edit it is,
`occurrence`, where there are several), so an entry survives the function moving in its file, and is
lost when the mutated line itself changes (then the survivor is shown again, to be judged again).
Exit status 1 when any survivor is unlisted or a mutant's verdict is not a verdict ("suspicious", "not
checked"), with a skeleton entry printed for each unlisted survivor; 0 otherwise.

`--changed-since BASE` mutates only the listed modules the change since BASE touches: the module
itself, or one of its test files (a test weakened can let a killed mutant live). The scratch copies
stay (default under the system's temporary directory), so a survivor can be looked at with
`cd WORKDIR/GROUP && mutmut show NAME` (the command is printed with it).

`--record` writes each module of the run with every mutant decided and no unlisted survivor to
`tools/mutation/runs.toml`, with a digest of what its verdicts rest on (`sources`: the module and its
test files as mutmut ran them, the `tests/` modules those import, its equivalents file) and its figures.
`--stale` mutates only the recorded modules whose digest changed since: what CI runs (`.ci/run`), so a
change pays for the modules it touches and nothing else, and a landing whose every touched module was run
and recorded pays nothing. Modules never run to completion are named, not run.

`--again` runs only the survivors of the last run in `--workdir` again, after copying in the tests as they
are now (mutmut's own rerun of named mutants): for tests written to kill them. It is refused where a
mutated module changed, or a test lost or changed a line, since the run (`sync_tests`): then a killed
verdict may no longer stand, and only a fresh run decides it.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
MODULES_FILE = ROOT / "tools" / "mutation" / "modules.toml"
EQUIVALENTS_DIR = ROOT / "tools" / "mutation" / "equivalents"  # one file per module
RUNS_FILE = ROOT / "tools" / "mutation" / "runs.toml"
TEST_IMPORT = re.compile(r"^\s*(?:from tests(?:\.(\w+))? import ([\w, ()]+)|import tests\.(\w+))", re.M)
DETECTED = ("killed", "timeout", "segfault", "caught by type check")
SURVIVING = ("survived", "no tests")
RESULT_LINE = re.compile(r"^\s+(\S+): (.+)$")


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One mutant's verdict, and (for survivors) what its diff changes."""
    name: str
    module: str
    function: str
    status: str
    removed: str = ""
    added: str = ""
    occurrence: int = 1  # the n-th mutant of its function making this same edit (in source order)

    def key(self) -> tuple[str, str, str, str, int]:
        return (self.module, self.function, self.removed, self.added, self.occurrence)


def load_modules(path: Path = MODULES_FILE) -> dict[str, tuple[str, ...]]:
    """Each mutated module (a path from the repository root) -> the test files its mutants run."""
    with path.open("rb") as f:
        return {module: tuple(tests) for module, tests in tomllib.load(f)["modules"].items()}


def load_equivalents(path: Path = EQUIVALENTS_DIR) -> dict[tuple[str, str, str, str, int], str]:
    """The listed equivalent mutants of `path` (a file, or every `.toml` file of a directory: one per
    module), keyed as `Mutant.key` (`occurrence` 1 unless given), each to its reason."""
    files = sorted(path.glob("*.toml")) if path.is_dir() else [path] if path.exists() else []
    entries = []
    for file in files:
        with file.open("rb") as f:
            entries += tomllib.load(f).get("equivalent", [])
    return {(e["module"], e["function"], _strip(e["before"]), _strip(e["after"]), e.get("occurrence", 1)): e["reason"]
            for e in entries}


def _strip(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def changed_files(base: str) -> set[str]:
    """The paths changed between `base` and the working tree, untracked files included."""
    diff = subprocess.run(["git", "-C", str(ROOT), "diff", "--no-renames", "--name-only", base, "--"],
                          check=True, capture_output=True, text=True).stdout.split()
    untracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard"],
                               check=True, capture_output=True, text=True).stdout.split()
    return set(diff) | set(untracked)


def select(modules: dict[str, tuple[str, ...]], patterns: Sequence[str] | None,
           changed: set[str] | None) -> dict[str, tuple[str, ...]]:
    """The modules to mutate: those matching `patterns` (all when None), and of those, where `changed`
    is given, the ones whose own file or one of whose test files changed."""
    chosen = {m: t for m, t in modules.items() if patterns is None or any(fnmatch.fnmatch(m, p) for p in patterns)}
    if changed is not None:
        chosen = {m: t for m, t in chosen.items() if m in changed or changed.intersection(t)}
    return chosen


def groups(modules: dict[str, tuple[str, ...]]) -> list[tuple[tuple[str, ...], list[str]]]:
    """Modules with the same test files, one mutmut run each: (tests, modules)."""
    by_tests: dict[tuple[str, ...], list[str]] = {}
    for module, tests in sorted(modules.items()):
        by_tests.setdefault(tests, []).append(module)
    return sorted(by_tests.items())


def sources(module: str, tests: Sequence[str], root: Path = ROOT) -> list[str]:
    """What a module's verdicts rest on: the module, its test files, the `tests/` modules those import
    (fakes, stand-ins, helpers: one level), and its equivalents file."""
    paths = [module, *tests]
    for test in tests:
        file = root / test
        text = file.read_text() if file.exists() else ""
        for match in TEST_IMPORT.finditer(text):
            sub, names, plain = match.groups()
            names = [sub] if sub else [plain] if plain else re.findall(r"\w+", names or "")
            paths += [f"tests/{n}.py" for n in names if (root / "tests" / f"{n}.py").exists()]
    paths.append(str(EQUIVALENTS_DIR.relative_to(ROOT) / equivalents_name(module)))
    return sorted(set(paths))


def equivalents_name(module: str) -> str:
    """The module's equivalents file: `ascend_compile/lowering/budget.py` -> `lowering.budget.toml`."""
    return module.removeprefix("ascend_compile/").removesuffix(".py").replace("/", ".") + ".toml"


def fingerprint(module: str, tests: Sequence[str], root: Path = ROOT) -> str:
    """A digest of everything `sources` names (a missing file counts as empty): the module and its tests
    as in `root` (the tree mutmut ran on), the equivalents as in the repository (what judged the run)."""
    digest = hashlib.sha256()
    for path in sources(module, tests, root):
        file = (ROOT if path.startswith("tools/") else root) / path
        digest.update(path.encode() + b"\0" + (file.read_bytes() if file.exists() else b"") + b"\0")
    return digest.hexdigest()[:16]


def load_runs(path: Path = RUNS_FILE) -> dict[str, dict]:
    """Each module's last complete run (every mutant decided, no unlisted survivor): its fingerprint and
    figures."""
    if not path.exists():
        return {}
    with path.open("rb") as f:
        return tomllib.load(f).get("run", {})


def stale(modules: dict[str, tuple[str, ...]], runs: dict[str, dict],
          root: Path = ROOT) -> dict[str, tuple[str, ...]]:
    """The modules whose complete run no longer stands: something it rested on changed since. Modules
    never run to completion are not chosen (`never_run` names them)."""
    return {m: t for m, t in modules.items() if m in runs and runs[m]["fingerprint"] != fingerprint(m, t, root)}


def never_run(modules: dict[str, tuple[str, ...]], runs: dict[str, dict]) -> list[str]:
    return sorted(m for m in modules if m not in runs)


def record(runs: dict[str, dict], table: dict[str, dict[str, int]], modules: dict[str, tuple[str, ...]],
           clean: dict[str, Path], path: Path = RUNS_FILE) -> None:
    """Write the runs file with each module of `clean` (run, every mutant decided, no unlisted survivor)
    recorded at the fingerprint of the tree it ran on (`clean`'s value: its scratch copy)."""
    runs = dict(runs)
    for module, root in clean.items():
        runs[module] = {"fingerprint": fingerprint(module, modules[module], root), **table[module]}
    lines = ["# Each module's last complete mutmut run (tools/mutation_ci.py --record): the digest of what its",
             "# verdicts rest on (`sources`: the module, its tests, the tests/ modules they import, its",
             "# equivalents file) and its figures. CI (`--stale`) runs mutmut again over a module whose digest",
             "# changed; every survivor must then be killed or listed again.", ""]
    for module in sorted(runs):
        lines.append(f'[run."{module}"]')
        lines += [f"{k} = {json.dumps(v)}" for k, v in sorted(runs[module].items())]
        lines.append("")
    path.write_text("\n".join(lines))


def copy_tree(dest: Path) -> None:
    """The working tree's files (tracked and untracked, not ignored) copied to `dest`, afresh."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def group_pyproject(text: str, modules: Sequence[str], tests: Sequence[str]) -> str:
    """`pyproject.toml` with its `[tool.mutmut]` table extended by the group's modules and tests (the
    table's own keys kept; values written as JSON, which TOML reads for strings, lists and numbers)."""
    table = tomllib.loads(text).get("tool", {}).get("mutmut", {})
    table = {**table, "only_mutate": list(modules), "pytest_add_cli_args_test_selection": list(tests)}
    lines, skipping = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skipping = line.strip() == "[tool.mutmut]"
        if not skipping:
            lines.append(line)
    lines += ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _mutmut(workdir: Path, *args: str, capture: bool = True) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mutmut", *args]
    return subprocess.run(command, cwd=workdir, capture_output=capture, text=True)


def _diff_lines(diff: str) -> tuple[str, str]:
    removed = [l[1:].strip() for l in diff.splitlines() if l.startswith("-") and not l.startswith("---")]
    added = [l[1:].strip() for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++")]
    return "\n".join(removed), "\n".join(added)


def _function(name: str, module: str) -> str:
    """`Class.method` or `function` from mutmut's mangled name (`pkg.mod.xǁClassǁmethod__mutmut_3`)."""
    mangled = name[len(module[:-3].replace("/", ".")) + 1:]
    mangled = re.sub(r"__mutmut_\d+$", "", mangled)
    return mangled.removeprefix("x_").removeprefix("xǁ").replace("ǁ", ".")


def results(workdir: Path, modules: Sequence[str]) -> list[Mutant]:
    """Every mutant of `modules` in `workdir`'s last run, survivors with their diff."""
    out = _mutmut(workdir, "results", "--all", "true").stdout
    prefixes = {m[:-3].replace("/", ".") + ".": m for m in modules}
    mutants = []
    for line in out.splitlines():
        match = RESULT_LINE.match(line)
        if not match:
            continue
        name, status = match.groups()
        module = next((m for p, m in prefixes.items() if name.startswith(p)), None)
        if module is None:
            continue
        removed = added = ""
        if status in SURVIVING:
            removed, added = _diff_lines(_mutmut(workdir, "show", name).stdout)
        mutants.append(Mutant(name, module, _function(name, module), status, removed, added))
    return _numbered(mutants)


def _numbered(mutants: list[Mutant]) -> list[Mutant]:
    """Each survivor with its occurrence among its function's survivors making the same edit, in
    mutmut's order (its numbers follow the source): two identical edits in one function are two
    entries, so listing one never hides the other."""
    seen: dict[tuple[str, str, str, str], int] = {}
    numbered = []
    for m in sorted(mutants, key=lambda m: (m.module, m.function, int(m.name.rsplit("_", 1)[1]))):
        if m.status in SURVIVING:
            seen[m.key()[:4]] = seen.get(m.key()[:4], 0) + 1
            m = dataclasses.replace(m, occurrence=seen[m.key()[:4]])
        numbered.append(m)
    return numbered


def run_group(workdir: Path, modules: Sequence[str], tests: Sequence[str], max_children: int) -> list[Mutant]:
    """One mutmut run over `modules` with `tests`, in a fresh copy of the tree at `workdir`."""
    copy_tree(workdir)
    pyproject = workdir / "pyproject.toml"
    pyproject.write_text(group_pyproject(pyproject.read_text(), modules, tests))
    print(f"mutation: {', '.join(modules)} with {' '.join(tests)} in {workdir}", flush=True)
    run = _mutmut(workdir, "run", "--max-children", str(max_children), capture=False)
    if run.returncode != 0:
        raise SystemExit(f"mutation: mutmut run failed (exit {run.returncode}) in {workdir}")
    return results(workdir, modules)


def only_added(before: str, after: str) -> bool:
    """Whether `after` is `before` with lines added and none removed or changed."""
    matcher = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False)
    return all(tag in ("equal", "insert") for tag, *_ in matcher.get_opcodes())


def sync_tests(workdir: Path, modules: Sequence[str], tests: Sequence[str], root: Path = ROOT) -> list[str]:
    """Copy the group's test files and the `tests/` modules they import from `root` into the group's last
    run in `workdir` (and mutmut's copy of the tree in it, where the tests run); the paths copied.
    Refused (`SystemExit`) where a mutated module changed since the run, or a test lost or changed a
    line: the run's killed verdicts then no longer stand, and only a fresh run decides them."""
    for module in modules:
        if (workdir / module).read_bytes() != (root / module).read_bytes():
            raise SystemExit(f"mutation: {module} changed since the run in {workdir}: run it afresh")
    paths = sorted({p for m in modules for p in sources(m, tests, root) if p.startswith("tests/")})
    for path in paths:
        old, new = workdir / path, (root / path).read_text()
        if old.exists() and not only_added(old.read_text(), new):
            raise SystemExit(f"mutation: {path} lost or changed a line since the run in {workdir}: run afresh")
    for path in paths:
        for base in (workdir, workdir / "mutants"):
            (base / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / path, base / path)
    return paths


def retest_survivors(workdir: Path, modules: Sequence[str], tests: Sequence[str], max_children: int) -> list[Mutant]:
    """The group's last run in `workdir`, its unlisted survivors run again against the tests as they are now
    (`sync_tests`; mutmut finds what new tests reach itself): the mutants killed stand on the run's
    tests, which the tests now hold unchanged, so each verdict is what a fresh run would give."""
    sync_tests(workdir, modules, tests)
    listed = load_equivalents()
    survivors = [m.name for m in results(workdir, modules) if m.status in SURVIVING and m.key() not in listed]
    print(f"mutation: {len(survivors)} survivors of {', '.join(modules)} run again in {workdir}", flush=True)
    if survivors:
        run = _mutmut(workdir, "run", "--max-children", str(max_children), *survivors, capture=False)
        if run.returncode != 0:
            raise SystemExit(f"mutation: mutmut run failed (exit {run.returncode}) in {workdir}")
    return results(workdir, modules)


def skeleton(mutant: Mutant) -> str:
    """An equivalents entry for `mutant`, its reason to be written."""
    occurrence = f"occurrence = {mutant.occurrence}\n" if mutant.occurrence > 1 else ""
    return (f"[[equivalent]]\nmodule = \"{mutant.module}\"\nfunction = \"{mutant.function}\"\n"
            f"before = '''{mutant.removed}'''\nafter = '''{mutant.added}'''\n{occurrence}reason = \"\"\n")


def report(mutants: Sequence[Mutant], equivalents: dict[tuple[str, str, str, str, int], str],
           workdirs: dict[str, Path]) -> tuple[dict[str, dict[str, int]], list[Mutant], list[Mutant]]:
    """Per module of the run (`workdirs`' keys; a module mutmut made no mutant of has a row of zeros):
    mutants, killed, equivalent, unlisted survivors; and the unlisted and the undecided."""
    table = {m: {"mutants": 0, "killed": 0, "equivalent": 0, "survived": 0} for m in workdirs}
    unlisted, undecided = [], []
    for m in mutants:
        row = table[m.module]
        row["mutants"] += 1
        if m.status in DETECTED:
            row["killed"] += 1
        elif m.status in SURVIVING and m.key() in equivalents:
            row["equivalent"] += 1
        elif m.status in SURVIVING:
            row["survived"] += 1
            unlisted.append(m)
        else:
            undecided.append(m)
    print(f"\n{'module':48} {'mutants':>7} {'killed':>6} {'equiv':>5} {'surv':>4} {'score':>6}")
    for module, row in sorted(table.items()):
        score = (row["killed"] + row["equivalent"]) / row["mutants"] if row["mutants"] else 1.0
        print(f"{module:48} {row['mutants']:7} {row['killed']:6} {row['equivalent']:5} {row['survived']:4} "
              f"{score:6.1%}")
    for m in unlisted:
        print(f"\nsurvivor ({m.status}): {m.name}  (cd {workdirs[m.module]} && mutmut show {m.name})")
        print(skeleton(m))
    for m in undecided:
        print(f"no verdict ({m.status}): {m.name}")
    return table, unlisted, undecided


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", help="glob patterns over the listed modules (default: all)")
    parser.add_argument("--changed-since", metavar="BASE", help="only modules the change since BASE touches")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ascend-mutation")
    parser.add_argument("--json", type=Path, help="write the per-module table here")
    parser.add_argument("--no-run", action="store_true", help="report the last run in --workdir, run nothing")
    parser.add_argument("--stale", action="store_true",
                        help="only modules whose last complete run (tools/mutation/runs.toml) no longer stands")
    parser.add_argument("--again", action="store_true",
                        help="run the survivors of the last run in --workdir again, with the tests as they are now")
    parser.add_argument("--record", action="store_true",
                        help="record each module run here with every survivor killed or listed in runs.toml")
    args = parser.parse_args(argv)
    changed = changed_files(args.changed_since) if args.changed_since else None
    listed, runs = load_modules(), load_runs()
    chosen = select(listed, args.modules, changed)
    if args.stale:
        print(f"mutation: never run to completion (not chosen): {', '.join(never_run(chosen, runs)) or 'none'}")
        chosen = stale(chosen, runs)
    if not chosen:
        print("mutation: no listed module to mutate")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mutants, workdirs = [], {}
    for i, (tests, modules) in enumerate(groups(chosen)):
        workdir = args.workdir / f"group{i}"
        workdirs.update({m: workdir for m in modules})
        if args.no_run:
            mutants += results(workdir, modules)
        elif args.again:
            mutants += retest_survivors(workdir, modules, tests, args.max_children)
        else:
            mutants += run_group(workdir, modules, tests, args.max_children)
    table, unlisted, undecided = report(mutants, load_equivalents(), workdirs)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    if args.record:
        failing = {m.module for m in (*unlisted, *undecided)}
        clean = {m: workdirs[m] for m in table if m not in failing}
        record(load_runs(), table, listed, clean)
        print(f"mutation: recorded {', '.join(sorted(clean)) or 'nothing'} in {RUNS_FILE.relative_to(ROOT)}")
    print(f"\nmutation: {len(mutants)} mutants, {len(unlisted)} unlisted survivors, {len(undecided)} without verdict")
    return 1 if unlisted or undecided else 0


if __name__ == "__main__":
    sys.exit(main())
