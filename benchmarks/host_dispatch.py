"""Host time per decode step through the documented entry, the device stubbed: what a caller pays.

    python benchmarks/host_dispatch.py [--layers 4 32 64] [--rounds 40] [--calls 50] [--json] [--check-costs]

The example model compiled with `ascend_compile.compile`, decode batches 16 down to 9 in turn (one
bucket, vLLM's fixed block-table width), the device's work stubbed as `cpu_runner.py --runner-only`
stubs it (replay, task updates and synchronize do nothing), `compiled(**step)` per step. At each
depth, in one process, us per step, best / median of `--rounds` rounds of `--calls` steps with the
collector off (the first three interleaved round by round), timed in the CPU time of the calling
thread (`time.thread_time`): with the device stubbed a step is this thread's work alone, and on a
shared machine the time other processes hold the core does not count:
- dynamo: the default, every call through dynamo's frame hook and guards;
- direct: `dispatch="direct"` on the same compiled model: calls go straight to the graph, checked
  by `ascend_compile/dispatch/checks.py`;
- runner alone: the artifact called with the arguments dynamo gathered for it (`--runner-only`);
- direct, frozen_parameters: `dispatch="direct"` with `frozen_parameters=True` (parameters'
  addresses not checked each step: KV caches and buffers are);
- dynamo's floor: the model compiled with a backend that does no work (the graph run once, its
  outputs returned on every call): what dynamo's dispatch alone costs, with the guards on modules'
  hook dicts that `ascend_compile.compile` turns on;
- floor, torch's guards: the same with torch's default guards (none on hook dicts), to compare.

`--check-costs` times, instead, dynamo's own guard manager for the frame (`check(f_locals)`) beside
the direct path's checks that walk the model (module types, hook registrations, parameters'
identity) and the alternatives they replace.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ascend_compile  # noqa: E402
from ascend_compile import compile_once  # noqa: E402
from ascend_compile.backend import backend  # noqa: E402
from ascend_compile.compile_once import CompiledStep  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from ascend_compile.lowering import served  # noqa: E402
from cpu_runner import MAX_LEN, stub_device  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402

BATCH = 16


def decode_steps(cfg: LlamaConfig) -> list[dict[str, torch.Tensor]]:
    """Decode steps of batches 16 down to 9 (one bucket), vLLM's fixed block-table width."""
    batch = PagedBatch(cfg, seed=0, table_width=MAX_LEN // cfg.block_size)
    rng = random.Random(0)
    return [batch.step([rng.randint(1, MAX_LEN) for _ in range(n)]) for n in range(BATCH, BATCH - 8, -1)]


def time_rounds(fns: dict[str, Callable[[Any], Any]], inputs: dict[str, list], rounds: int,
                calls: int) -> dict[str, tuple[float, float]]:
    """(best, median) us of thread CPU time per call of each of `fns` over its `inputs` in turn, rounds
    interleaved."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        for i in range(50):
            fn(inputs[name][i % len(inputs[name])])
    gc.collect()
    gc.disable()  # as timeit does: a collection walking the whole process heap is no step's work
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                items = inputs[name]
                start = time.thread_time()
                for i in range(calls):
                    fn(items[i % len(items)])
                times[name].append((time.thread_time() - start) / calls * 1e6)
    finally:
        gc.enable()
    return {name: (round(min(t), 1), round(statistics.median(t), 1)) for name, t in times.items()}


def compiled_pair(cfg: LlamaConfig, frozen_parameters: bool) -> tuple[CompiledStep, CompiledStep, Any]:
    """The model compiled once through `ascend_compile.compile(..., dispatch="direct")`, the same
    compiled model called through dynamo, and its artifact, the device stubbed after the first step."""
    torch._dynamo.reset()
    artifacts: list = []
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(8, 16), frozen_parameters=frozen_parameters)
    model = build(cfg)
    direct = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append), dispatch="direct")
    guarded = CompiledStep(direct.compiled, model)
    with torch.no_grad():
        direct(**decode_steps(cfg)[0])
    stub_device(artifacts[-1])
    return direct, guarded, artifacts[-1]


def no_work_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """A backend that runs the graph once and returns those outputs on every call."""
    outputs: list = []

    def run(*args: Any) -> Any:
        if not outputs:
            outputs.append(gm.forward(*args))
        return outputs[0]

    return run


def measure(layers: int, rounds: int, calls: int) -> dict[str, Any]:
    """The six figures at one depth, us per step (best, median)."""
    cfg = LlamaConfig(num_layers=layers, num_blocks=BATCH * MAX_LEN // 16)
    steps = decode_steps(cfg)
    row: dict[str, Any] = {"layers": layers}
    with torch.no_grad():
        direct, guarded, art = compiled_pair(cfg, frozen_parameters=False)
        with served.probe() as seen:
            for step in steps:
                guarded(**step)
        row["inputs"] = len(seen[0].args)
        row.update(time_rounds({"dynamo": lambda s: guarded(**s), "direct": lambda s: direct(**s),
                                "runner": lambda a: art(*a)},
                               {"dynamo": steps, "direct": steps, "runner": [c.args for c in seen]}, rounds, calls))
        del direct, guarded, art, seen
        direct, _, _ = compiled_pair(cfg, frozen_parameters=True)
        row.update(time_rounds({"direct_frozen": lambda s: direct(**s)}, {"direct_frozen": steps}, rounds, calls))
        del direct
        torch._dynamo.reset()
        floor = ascend_compile.compile(build(cfg), backend=no_work_backend)
        row.update(time_rounds({"floor": lambda s: floor(**s)}, {"floor": steps}, rounds, calls))
        torch._dynamo.reset()
        saved, compile_once.GUARD_SETTINGS = compile_once.GUARD_SETTINGS, ()
        try:  # torch's default guards: none on the modules' hook dicts
            floor = ascend_compile.compile(build(cfg), backend=no_work_backend)
            row.update(time_rounds({"floor_default": lambda s: floor(**s)}, {"floor_default": steps}, rounds, calls))
        finally:
            compile_once.GUARD_SETTINGS = saved
    torch._dynamo.reset()
    return row


def check_costs(layers: int) -> dict[str, float]:
    """us per call of dynamo's own guard manager for the frame and of the direct path's checks that
    walk the model (the figures the README's "Calling the graph directly" gives), at one depth."""
    import operator

    from torch.utils.hooks import RemovableHandle

    cfg = LlamaConfig(num_layers=layers, num_blocks=BATCH * MAX_LEN // 16)
    model, steps = build(cfg), decode_steps(cfg)
    modules = tuple(model.modules())
    types = tuple(map(type, modules))
    hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                                m._backward_pre_hooks))
    params = tuple(model.parameters())
    held, count = tuple(params), RemovableHandle.next_id
    torch._dynamo.reset()
    floor = ascend_compile.compile(model, backend=no_work_backend)
    with torch.no_grad():
        floor(**steps[0])
    (entry,) = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(type(model).forward.__code__)
    f_locals = dict(self=model, **steps[1])
    costs = {
        "dynamo's guard manager": lambda: entry.guard_manager.check(f_locals),
        "module types": lambda: tuple(map(type, modules)) == types,
        "any(hook dicts)": lambda: any(hooks),
        "hook registrations": lambda: RemovableHandle.next_id == count,
        "parameters' identity": lambda: all(map(operator.is_, params, held)),
        "parameters' addresses": lambda: list(map(torch.Tensor.data_ptr, params)),
    }
    calls = {name: (lambda fn: lambda _: fn())(fn) for name, fn in costs.items()}
    with torch.no_grad():  # as the step was compiled: else the guards fail at their first (global state)
        if not entry.guard_manager.check(f_locals):
            raise RuntimeError(f"dynamo's guards fail: {entry.guard_manager.check_verbose(f_locals).verbose_code_parts}")
        row = time_rounds(calls, {name: [None] for name in calls}, 10, 50)
    torch._dynamo.reset()
    return {"modules": len(modules), "hook dicts": len(hooks), "parameters": len(params),
            **{name: best for name, (best, _) in row.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32, 64])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check-costs", action="store_true",
                        help="instead: us per call of dynamo's guard manager and of the direct checks that walk the model")
    args = parser.parse_args()
    if args.check_costs:
        for layers in args.layers:
            print(json.dumps({"layers": layers, **check_costs(layers)}), flush=True)
        return
    measure(2, 3, 50)  # warm-up: the first measurement of a process runs slow
    names = {"dynamo": "dynamo (default)", "direct": "direct", "direct_frozen": "direct, frozen_parameters",
             "floor": "dynamo's floor", "floor_default": "floor, torch's guards", "runner": "runner alone"}
    if not args.json:
        print(f"host us per decode step, thread CPU time (batches {BATCH} to {BATCH - 7} in turn, device stubbed), "
              f"best / median of {args.rounds} rounds of {args.calls} steps")
        print(f"{'layers':>6} {'inputs':>6} " + " ".join(f"{v:>26}" for v in names.values()))
    rows = []
    for layers in args.layers:
        row = measure(layers, args.rounds, args.calls)
        rows.append(row)
        if not args.json:
            print(f"{layers:>6} {row['inputs']:>6} " + " ".join(
                f"{f'{row[k][0]:.1f} / {row[k][1]:.1f}':>26}" for k in names), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
