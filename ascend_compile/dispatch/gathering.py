"""The graph's arguments as one generated function of a call's arguments.

Each source becomes an expression over the call (`frame.local_expressions`). Sources that walk only
modules' `_modules` / `_parameters` / `_buffers` from a module (its parameters, buffers, KV caches)
are evaluated once, into tuples of consecutive inputs the function joins (`T0 + (k['ids'],) + T1`, or
`(*T0, k['ids'], *T1)` where that copies less: at C speed, the tuple the runner takes); the others (the caller's tensors, their sizes,
tensors reached through other objects) are evaluated on every call.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Callable, Sequence

import torch

from .codegen import Check, compile_function, evaluate
from .frame import LOCAL

#: A source that walks only modules' submodules, parameters and buffers from a local.
MODULE_STATE = re.compile(r"L\['(\w+)'\](?:\._(?:modules|parameters|buffers)\['[^'\\]*'\])+")


@dataclasses.dataclass(frozen=True)
class Gathering:
    """Which inputs are gathered once (`state`, from the modules `roots`) and which per call."""

    expressions: tuple[str, ...]  # each input's, over the call
    state: tuple[int, ...]
    per_call: tuple[int, ...]
    roots: tuple[str, ...]  # the locals whose modules `state` walks

    @classmethod
    def of(cls, sources: Sequence[str], exprs: dict[str, str], namespace: dict[str, Any], a: tuple,
           k: dict) -> "Gathering":
        """The gathering of `sources` for calls like (`a`, `k`), whose locals are `exprs`; the inputs
        gathered once go into `namespace` (as tuples `T0`, `T1`, ... of consecutive ones)."""
        expressions = tuple(LOCAL.sub(lambda m: exprs[m.group(1)], s) for s in sources)
        state = tuple(i for i, s in enumerate(sources) if MODULE_STATE.fullmatch(s) and isinstance(
            evaluate(exprs[LOCAL.match(s).group(1)], namespace, a, k), torch.nn.Module))
        roots = tuple(sorted({LOCAL.match(sources[i]).group(1) for i in state}))
        per_call = tuple(i for i in range(len(sources)) if i not in state)
        gathering = cls(expressions, state, per_call, roots)
        for j, run in enumerate(gathering._runs()):
            namespace[f"T{j}"] = tuple(evaluate(expressions[i], namespace, a, k) for i in run)
        return gathering

    def _runs(self) -> list[list[int]]:
        """The inputs gathered once, in runs of consecutive positions."""
        runs: list[list[int]] = []
        for i in self.state:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _lines(self) -> list[str]:
        """`A = ...`: the runs' tuples and the per-call expressions in order, joined by tuple
        concatenation where that copies fewer references than unpacking into one tuple (which
        builds a list, copies it into the tuple and frees it: about three references moved per
        input; a concatenation copies the tuple built so far, so it wins while the long runs come late)."""
        runs = {run[0]: (j, len(run)) for j, run in enumerate(self._runs())}
        items, parts, loose, i = [], [], [], 0
        while i < len(self.expressions):
            if i in runs:
                j, length = runs[i]
                items.append(f"*T{j}")
                parts += [(f"({', '.join(loose)},)", len(loose))] if loose else []
                parts.append((f"T{j}", length))
                loose = []
                i += length
            else:
                items.append(self.expressions[i])
                loose.append(self.expressions[i])
                i += 1
        parts += [(f"({', '.join(loose)},)", len(loose))] if loose else []
        prefixes = itertools.accumulate(length for _, length in parts)
        copied = sum(itertools.islice(prefixes, 1, None))  # each `+` copies the tuple built so far and the part
        if parts and copied < 3 * len(self.expressions):
            return [f"    A = {' + '.join(expr for expr, _ in parts)}"]
        return [f"    A = ({', '.join(items)},)"]

    def fill(self, checks: Sequence[Check], namespace: dict[str, Any]) -> Callable[[tuple, dict, list], list | None]:
        """`fill(a, k, A)`: the graph's arguments for a call written into `A`, a list of an earlier
        call's (its positions gathered once are those of every call, and stay): only the per-call
        inputs are written. None where one of `checks` fails (`A` then holds some of this call's)."""
        stores = [f"    A[{i}] = {self.expressions[i]}" for i in self.per_call]
        return compile_function("fill", _checked(checks, stores), namespace, "a, k, A")

    def build(self, namespace: dict[str, Any]) -> Callable[[tuple, dict], tuple]:
        """`build(a, k)`: the graph's arguments for a call, unchecked."""
        return compile_function("build", [*self._lines(), "    return A"], namespace)

    def gather(self, checks: Sequence[Check], namespace: dict[str, Any]) -> Callable[[tuple, dict], tuple | None]:
        """`gather(a, k)`: the graph's arguments for a call, or None where one of `checks` fails."""
        return compile_function("gather", _checked(checks, self._lines()), namespace)


def _checked(checks: Sequence[Check], lines: list[str]) -> list[str]:
    """A body making `A` by `lines`, returning it, or None where one of `checks` fails: those that run
    before the arguments are gathered first, the others after."""
    pre = [c.expr for c in checks if c.before_gather]
    post = [c.expr for c in checks if not c.before_gather]
    body = [f"    if not ({' and '.join(pre)}):", "        return None"] if pre else []
    body += lines
    body += [f"    if not ({' and '.join(post)}):", "        return None"] if post else []
    return [*body, "    return A"]
