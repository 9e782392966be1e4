"""What issue 10 made true of the package's code, kept true: small modules, no switch on a runtime's
name, no kernel-argument positions outside the kernel-call contract, no test-only switches."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[1] / "ascend_compile"


def _sources(*folders: str) -> dict[str, str]:
    roots = [PACKAGE / f for f in folders] if folders else [PACKAGE]
    return {str(p.relative_to(PACKAGE)): p.read_text() for root in roots
            for p in ([root] if root.is_file() else root.rglob("*.py"))}


def test_no_module_over_400_lines():
    long = {name: text.count("\n") for name, text in _sources().items() if text.count("\n") > 400}
    assert not long, long


def test_no_switch_on_a_runtime_name():
    pattern = re.compile(r"runtime\.name\s*(==|!=|in\b)|\.name\s*==\s*[\"'](sim|npu|cuda|eager)[\"']")
    found = {name: pattern.findall(text) for name, text in
             _sources("backend.py", "targets.py", "passes", "lowering").items() if pattern.search(text)}
    assert not found, found


def test_kernel_arguments_by_name_only():
    pattern = re.compile(r"WORKSPACE_ARG|HOST_ARG_INDEX|\.args\[4:\]")
    found = [name for name, text in _sources().items() if pattern.search(text)]
    assert not found, found


def test_no_test_only_switch_in_the_package():
    pattern = re.compile(r"\bLEGACY\b|def legacy\(")
    found = [name for name, text in _sources().items() if pattern.search(text)]
    assert not found, found


def _package_imports(folder: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (`from .x import`, `from . import x`),
    at any depth: lazy and TYPE_CHECKING imports included."""
    import ast

    root = PACKAGE / folder
    names = {p.stem for p in root.glob("*.py")}
    imports: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        imports[path.stem] = found & names
    return imports


def test_the_vllm_package_imports_in_one_direction():
    imports = _package_imports("integrations/vllm")
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for other in imports[module]:
                visit(other, path + (module,))
            done.add(module)

    for module in imports:
        visit(module, ())


def test_no_module_imports_vllm_at_import_time():
    """vLLM is imported inside the functions that read it, never by a module's own statements."""
    import ast

    def top_level(body: list) -> Iterator[ast.stmt]:
        for node in body:
            yield node
            if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import ...` run at import
                for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    yield from top_level(part)

    found = []
    for name, text in _sources().items():
        for node in top_level(ast.parse(text).body):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [(name, m) for m in modules if m.split(".")[0] in ("vllm", "vllm_ascend")]
    assert not found, found
