"""`tools/mutation_ci.py`: which modules a change sends to mutmut, how they are grouped by their tests,
the `[tool.mutmut]` table each group's copy gets, and which survivors the equivalents file lists (by
function and the mutated lines, not by mutmut's numbering or the line's position). No mutmut run here."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import mutation_ci  # noqa: E402

MODULES = {
    "pkg/dispatch/a.py": ("tests/test_d.py", "tests/test_s.py"),
    "pkg/dispatch/b.py": ("tests/test_d.py", "tests/test_s.py"),
    "pkg/passes/m.py": ("tests/test_m.py",),
}


def test_a_change_selects_the_module_it_touches_or_whose_tests_it_touches():
    assert set(mutation_ci.select(MODULES, None, {"pkg/dispatch/b.py", "README.md"})) == {"pkg/dispatch/b.py"}
    # a test file weakened can let a killed mutant live: every module it owns is run again
    assert set(mutation_ci.select(MODULES, None, {"tests/test_s.py"})) == {"pkg/dispatch/a.py", "pkg/dispatch/b.py"}
    assert mutation_ci.select(MODULES, None, {"pkg/other.py", "tests/test_x.py"}) == {}
    assert set(mutation_ci.select(MODULES, ["pkg/passes/*"], None)) == {"pkg/passes/m.py"}
    assert mutation_ci.select(MODULES, ["pkg/passes/*"], {"pkg/dispatch/a.py"}) == {}


def test_modules_with_the_same_tests_are_one_run():
    assert mutation_ci.groups(MODULES) == [
        (("tests/test_d.py", "tests/test_s.py"), ["pkg/dispatch/a.py", "pkg/dispatch/b.py"]),
        (("tests/test_m.py",), ["pkg/passes/m.py"]),
    ]


def test_a_groups_pyproject_keeps_the_shared_settings_and_names_its_modules_and_tests():
    text = ('[project]\nname = "p"\n\n[tool.mutmut]\nsource_paths = ["pkg/"]\nprocess_isolation = "forkserver"\n'
            '\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    data = tomllib.loads(mutation_ci.group_pyproject(text, ["pkg/passes/m.py"], ["tests/test_m.py"]))
    assert data["tool"]["mutmut"] == {"source_paths": ["pkg/"], "process_isolation": "forkserver",
                                      "only_mutate": ["pkg/passes/m.py"],
                                      "pytest_add_cli_args_test_selection": ["tests/test_m.py"]}
    assert data["tool"]["pytest"]["ini_options"] == {"testpaths": ["tests"]}
    assert data["project"]["name"] == "p"


def test_survivors_are_listed_by_function_and_mutated_lines(tmp_path, capsys):
    equivalents = tmp_path / "equivalents.toml"
    equivalents.write_text("[[equivalent]]\nmodule = \"pkg/passes/m.py\"\nfunction = \"Plan.size\"\n"
                           "before = '''  n = a + b'''\nafter = '''n = a - b  '''\nreason = \"a and b are 0\"\n")
    listed = mutation_ci.load_equivalents(equivalents)
    diff = "--- pkg/passes/m.py\n+++ pkg/passes/m.py\n@@ -3 +3 @@\n-        n = a + b\n+        n = a - b\n"
    removed, added = mutation_ci._diff_lines(diff)
    name = "pkg.passes.m.xǁPlanǁsize__mutmut_7"
    function = mutation_ci._function(name, "pkg/passes/m.py")
    assert function == "Plan.size"
    same = mutation_ci.Mutant(name, "pkg/passes/m.py", function, "survived", removed, added)
    # the same edit of a second `a + b` in the function: its own entry, not hidden by the first's
    twin = mutation_ci.Mutant("pkg.passes.m.xǁPlanǁsize__mutmut_12", "pkg/passes/m.py", function, "survived",
                              removed, added)
    other_line = mutation_ci.Mutant("pkg.passes.m.xǁPlanǁsize__mutmut_8", "pkg/passes/m.py", "Plan.size",
                                    "survived", "n = a + b", "n = a * b")
    untested = mutation_ci.Mutant("pkg.passes.m.x_top__mutmut_1", "pkg/passes/m.py", "top", "no tests", "x", "y")
    killed = mutation_ci.Mutant("pkg.passes.m.x_top__mutmut_2", "pkg/passes/m.py", "top", "killed")
    odd = mutation_ci.Mutant("pkg.passes.m.x_top__mutmut_3", "pkg/passes/m.py", "top", "suspicious")
    mutants = mutation_ci._numbered([twin, same, other_line, untested, killed, odd])
    twin = next(m for m in mutants if m.name == twin.name)
    assert twin.occurrence == 2
    table, unlisted, undecided = mutation_ci.report(mutants, listed, {"pkg/passes/m.py": tmp_path})
    assert table["pkg/passes/m.py"] == {"mutants": 6, "killed": 1, "equivalent": 1, "survived": 3}
    assert set(unlisted) == {twin, other_line, untested}  # "no tests": no test of the group reaches it
    assert undecided == [odd]
    out = capsys.readouterr().out
    assert "before = '''n = a + b'''\nafter = '''n = a * b'''" in out  # the skeleton to judge it by
    assert "after = '''n = a - b'''\noccurrence = 2\n" in out


def test_every_listed_module_exists_and_names_existing_test_files():
    root = TOOLS.parent
    modules = mutation_ci.load_modules()
    assert modules
    for module, tests in modules.items():
        assert (root / module).is_file(), module
        assert tests and all((root / t).is_file() for t in tests), (module, tests)
    for module, *_ in mutation_ci.load_equivalents():
        assert module in modules, module


def test_equivalents_are_read_from_every_file_of_the_directory(tmp_path):
    entry = ("[[equivalent]]\nmodule = \"pkg/{m}.py\"\nfunction = \"f\"\nbefore = '''x = 1'''\n"
             "after = '''x = 2'''\nreason = \"unread\"\n")
    (tmp_path / "a.toml").write_text(entry.format(m="a"))
    (tmp_path / "b.toml").write_text(entry.format(m="b") + "\n" + entry.format(m="b").replace("x = 2", "x = 3"))
    (tmp_path / "notes.txt").write_text(entry.format(m="c"))
    listed = mutation_ci.load_equivalents(tmp_path)
    assert set(listed) == {("pkg/a.py", "f", "x = 1", "x = 2", 1), ("pkg/b.py", "f", "x = 1", "x = 2", 1),
                           ("pkg/b.py", "f", "x = 1", "x = 3", 1)}
    # the repository's own: each file lists only its module's survivors
    for file in mutation_ci.EQUIVALENTS_DIR.glob("*.toml"):
        modules = {key[0] for key in mutation_ci.load_equivalents(file)}
        assert modules == {"ascend_compile/" + file.stem.replace(".", "/") + ".py"}, file.name


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_recorded_run_stands_until_the_module_its_tests_or_what_they_import_change(tmp_path):
    modules = {"ascend_compile/m.py": ("tests/test_m.py",), "ascend_compile/n.py": ("tests/test_n.py",)}
    _tree(tmp_path, {"ascend_compile/m.py": "x = 1\n", "ascend_compile/n.py": "y = 1\n",
                     "tests/test_m.py": "from tests import fake_m, other\nfrom tests.helper_m import f\n",
                     "tests/fake_m.py": "A = 1\n", "tests/other.py": "", "tests/helper_m.py": "",
                     "tests/test_n.py": "import tests.fake_n\n", "tests/fake_n.py": ""})
    assert mutation_ci.sources("ascend_compile/m.py", modules["ascend_compile/m.py"], tmp_path) == [
        "ascend_compile/m.py", "tests/fake_m.py", "tests/helper_m.py", "tests/other.py", "tests/test_m.py",
        "tools/mutation/equivalents/m.toml"]
    assert "tests/fake_n.py" in mutation_ci.sources("ascend_compile/n.py", modules["ascend_compile/n.py"], tmp_path)
    runs_file = tmp_path / "runs.toml"
    table = {"ascend_compile/m.py": {"mutants": 3, "killed": 2, "equivalent": 1, "survived": 0}}
    mutation_ci.record({}, table, modules, {"ascend_compile/m.py": tmp_path}, runs_file)
    runs = mutation_ci.load_runs(runs_file)
    assert runs["ascend_compile/m.py"]["killed"] == 2 and set(runs) == {"ascend_compile/m.py"}
    # n was never run to completion: named, not chosen; m stands
    assert mutation_ci.never_run(modules, runs) == ["ascend_compile/n.py"]
    assert mutation_ci.stale(modules, runs, tmp_path) == {}
    for changed in ("ascend_compile/m.py", "tests/test_m.py", "tests/fake_m.py", "tests/helper_m.py"):
        before = (tmp_path / changed).read_text()
        (tmp_path / changed).write_text(before + "# weakened\n")
        assert mutation_ci.stale(modules, runs, tmp_path) == {"ascend_compile/m.py": ("tests/test_m.py",)}, changed
        (tmp_path / changed).write_text(before)
    assert mutation_ci.stale(modules, runs, tmp_path) == {}
    (tmp_path / "ascend_compile/n.py").write_text("y = 2\n")  # not recorded: still not chosen
    assert mutation_ci.stale(modules, runs, tmp_path) == {}


def test_the_recorded_runs_are_complete_runs_of_listed_modules():
    """Every module recorded in tools/mutation/runs.toml is a listed module whose run was complete: every
    mutant killed or listed (whether it still stands is CI's `--stale` run)."""
    runs, modules = mutation_ci.load_runs(), mutation_ci.load_modules()
    assert set(runs) <= set(modules)
    for module, run in runs.items():
        assert run["killed"] + run["equivalent"] == run["mutants"] and run["survived"] == 0, module


def test_survivors_are_run_again_only_against_tests_that_only_gained_lines(tmp_path):
    """`--again` (`sync_tests`): the group's tests and what they import copied into the run's tree and
    mutmut's copy of it; refused where the mutated module changed since the run, or a test lost or
    changed a line (a killed verdict may no longer stand)."""
    import pytest

    modules = {"ascend_compile/m.py": ("tests/test_m.py",)}
    files = {"ascend_compile/m.py": "x = 1\n", "tests/test_m.py": "from tests import fake_m\ndef test(): pass\n",
             "tests/fake_m.py": "A = 1\n"}
    root, workdir = tmp_path / "root", tmp_path / "run"
    _tree(root, files)
    _tree(workdir, files)
    (root / "tests/test_m.py").write_text(files["tests/test_m.py"] + "def test_more(): assert True\n")
    args = (workdir, list(modules), modules["ascend_compile/m.py"], root)
    assert mutation_ci.sync_tests(*args) == ["tests/fake_m.py", "tests/test_m.py"]
    for base in (workdir, workdir / "mutants"):
        assert (base / "tests/test_m.py").read_text().endswith("def test_more(): assert True\n")
        assert (base / "tests/fake_m.py").read_text() == "A = 1\n"
    for path, text in (("tests/test_m.py", "from tests import fake_m\n"), ("tests/fake_m.py", "A = 2\n"),
                       ("ascend_compile/m.py", "x = 1\n# more\n")):
        before = (root / path).read_text()
        (root / path).write_text(text)
        with pytest.raises(SystemExit, match=path):
            mutation_ci.sync_tests(*args)
        (root / path).write_text(before)
    assert mutation_ci.only_added("a\nb\n", "a\nc\nb\n") and not mutation_ci.only_added("a\nb\n", "a\nc\n")


def test_a_module_mutmut_makes_no_mutant_of_is_a_complete_run(tmp_path, capsys):
    """A module of the run with no mutant (module-level code only, as `integrations/vllm/__init__.py`) has
    its row, all zeros, and is recorded as run: nothing of it is left undecided."""
    killed = mutation_ci.Mutant("pkg.passes.m.x_top__mutmut_1", "pkg/passes/m.py", "top", "killed")
    workdirs = {"pkg/passes/m.py": tmp_path, "pkg/passes/__init__.py": tmp_path}
    table, unlisted, undecided = mutation_ci.report([killed], {}, workdirs)
    assert table["pkg/passes/__init__.py"] == {"mutants": 0, "killed": 0, "equivalent": 0, "survived": 0}
    assert table["pkg/passes/m.py"] == {"mutants": 1, "killed": 1, "equivalent": 0, "survived": 0}
    assert not unlisted and not undecided
    assert "pkg/passes/__init__.py" in capsys.readouterr().out
