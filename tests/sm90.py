"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU: Triton ships its own
ptxas, so a kernel compiles for any target; what it uses (registers, spilled bytes, shared memory,
the depth of its pipelined buffers) is read from the result. Used by the kernel tests
(`tests/test_triton_kernels.py`, `tests/test_triton_mla.py`) to catch what the interpreter does not
check: a tile that spills or passes the 227 KB a Hopper program may use.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Shared memory one Hopper program may use (227 KB; an SM has 228 KB).
HOPPER_SHARED = 232448

#: The script's first part: `build(fn, types, constexprs, stages, warps, tile)` compiles `fn` for
#: sm_90 with the strides named `stride*d` set to 1 (as the JIT specialises them) and returns
#: (registers, spilled bytes, shared memory, depth): cuobjdump's REG and STACK (-1 without
#: cuobjdump), and the fewest buffers of a `tile`-shaped shared allocation (the tiles a pipelined
#: key loop keeps in flight; 0 for a kernel without one). `report(*name, result=...)` prints a row.
PRELUDE = r"""
import os, re, subprocess, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, constexprs, stages, warps=4, tile="64x128x"):
    names = fn.arg_names
    constexprs = dict(constexprs, **{n: 1 for n in names if n.startswith("stride") and n.endswith("d")})
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in constexprs and (sig[n].startswith("*") or n.startswith("stride"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    depth = [int(d) for d in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x" + tile, kernel.asm["ttgir"])]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return -1, -1, kernel.metadata.shared, min(depth, default=0)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(re.search(name + r":(\d+)", usage).group(1)) for name in ("REG", "STACK"))
    return regs, stack, kernel.metadata.shared, min(depth, default=0)

def report(*name, result):
    print(*name, *result, flush=True)
"""


def compile_rows(body: str, timeout: int = 300) -> tuple[list[list[str]], str]:
    """Run `PRELUDE + body` in a process without `TRITON_INTERPRET`: (its printed rows, split into
    words, and its whole output for assertion messages). Fails the calling test if the script fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split() for line in result.stdout.splitlines()], result.stdout
