"""What issue 10 made true of the package's code, kept true: small modules, no switch on a runtime's
name, no kernel-argument positions outside the kernel-call contract, no test-only switches."""
from __future__ import annotations

import re
from pathlib import Path

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
