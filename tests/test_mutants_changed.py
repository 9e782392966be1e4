"""`tools/mutants.py --changed-since`: which mutants CI re-runs for a change (`tools/mutants_changed.py`),
on a scratch repository with three mutants, each change one of the rules."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import mutants_changed  # noqa: E402

MUTANTS = '''
from mutants import Mutant  # tools/mutants.py's, on the path above

MUTANTS = (
    Mutant("ops bug", "pkg/ops/a.py", "x", "y", ("tests/test_ops.py::test_one",)),
    Mutant("runner bug", "pkg/lowering/runner.py", "x", "y", ("tests/test_runner.py",)),
    Mutant("sim bug", "pkg/sim/rules.py", "x", "y", ("tests/test_sim.py",)),
)
'''
FILES = {
    "tools/mutants.py": MUTANTS,
    "pkg/ops/a.py": "x = 1\n", "pkg/ops/b.py": "b = 1\n", "pkg/lowering/runner.py": "x = 1\n",
    "pkg/sim/rules.py": "x = 1\n", "tests/test_ops.py": "", "tests/test_runner.py": "", "tests/test_sim.py": "",
    "tests/helpers.py": "", "pyproject.toml": '[project]\nname = "p"\ndependencies = ["torch>=2.13"]\n'
                                              '[project.entry-points.x]\ny = "pkg.a:f"\n',
}


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return tmp_path, _git(tmp_path, "rev-parse", "HEAD")


def _selected(root: Path, base: str) -> list[str]:
    mutants = mutants_changed.load_mutants((root / "tools/mutants.py").read_text())
    return [m.name for m in mutants_changed.select(mutants, root, base)[0]]


def test_nothing_changed_runs_nothing(repo):
    root, base = repo
    assert _selected(root, base) == []


def test_a_sibling_module_or_a_test_file_changed_runs_its_mutants_only(repo):
    root, base = repo
    (root / "pkg/ops/b.py").write_text("b = 2\n")  # a sibling of the ops mutant's file, uncommitted
    assert _selected(root, base) == ["ops bug"]
    (root / "tests/test_sim.py").write_text("# weakened\n")
    assert _selected(root, base) == ["ops bug", "sim bug"]


def test_a_changed_or_new_definition_runs_that_mutant(repo):
    root, base = repo
    text = (root / "tools/mutants.py").read_text().replace('"pkg/sim/rules.py", "x", "y"', '"pkg/sim/rules.py", "x", "z"')
    (root / "tools/mutants.py").write_text(text)
    assert _selected(root, base) == ["sim bug"]


def test_what_every_test_stands_on_runs_every_mutant(repo):
    root, base = repo
    (root / "tests/hypothesis-db/ab").mkdir(parents=True)  # what a run of the suite saves: not code
    (root / "tests/hypothesis-db/ab/cd").write_bytes(b"example")
    assert _selected(root, base) == []
    (root / "tests/helpers.py").write_text("# changed\n")
    assert _selected(root, base) == ["ops bug", "runner bug", "sim bug"]


def test_pyproject_counts_for_its_requirements_not_its_entry_points(repo):
    root, base = repo
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pkg.a:f"', '"pkg.b:f"'))
    assert _selected(root, base) == []
    pyproject.write_text(pyproject.read_text().replace("torch>=2.13", "torch>=2.14"))
    assert _selected(root, base) == ["ops bug", "runner bug", "sim bug"]


def test_a_base_outside_the_history_runs_every_mutant(repo):
    root, _ = repo
    assert _selected(root, "0" * 40) == ["ops bug", "runner bug", "sim bug"]



class _Worker:
    """A mutant worker's answer, as `Worker.run` gives it: pytest's exit status and its output."""

    def __init__(self, code: int, output: str) -> None:
        self.answer = code, output
        self.python = sys.executable

    def run(self, root, tests):
        return self.answer


def test_a_mutant_naming_a_test_that_does_not_exist_is_an_error_not_caught():
    """pytest fails (exit 4) when a named test does not exist: a renamed test would catch its mutants
    falsely (an MLA mutant did, until this check). Where the unmutated tree collects the test, the
    mutant broke its collection: caught."""
    import mutants

    gone = "tests/test_mutants_changed.py::test_gone"
    with pytest.raises(LookupError, match=r"test_mutants_changed.py::test_gone.*update the mutant"):
        mutants.run_tests((gone,), Path("."), _Worker(4, f"ERROR: not found: /r/{gone}\n(no match in any of [<Module>])"))
    here = "tests/test_mutants_changed.py::test_nothing_changed_runs_nothing"
    assert mutants.uncollected((here,), sys.executable) == []
    assert mutants.run_tests((here,), Path("."), _Worker(4, f"ERROR: not found: /r/{here}")) == (True, "pytest exit 4")
    assert mutants.run_tests(("tests/test_x.py::test_one",), Path("."),
                             _Worker(1, "FAILED tests/test_x.py::test_one - assert 1 == 2")) == (True, "tests/test_x.py::test_one")
    assert mutants.run_tests(("tests/test_x.py::test_one",), Path("."), _Worker(0, "1 passed")) == (False, "pytest exit 0")
