"""Host time per decode step through the documented entry, the device stubbed: what a caller pays.

    python benchmarks/host_dispatch.py [--layers 4 32 64] [--rounds 40] [--calls 50] [--json] [--check-costs]
    python benchmarks/host_dispatch.py --vllm [--layers 64]   # where vLLM is installed (.ci/vllm-venv)

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

`--vllm` times, instead, vLLM's own Llama (`tests/vllm_real.py`: vLLM's model, `Attention` layers, ops and
forward context on the CPU; tiny dims, `--layers` deep) compiled through vLLM's mode-1 call with our
backend, the same decode batches, each step's forward context entered outside the timed call (it is
vLLM's cost either way), beside the standalone "direct, frozen_parameters" row in the same process:
- vLLM, dynamo: `ASCEND_COMPILE_OPTIONS {"dispatch": "dynamo"}`, every step through dynamo's guards;
- vLLM, direct: the integration's default (`integrations/vllm/fast_path.py`);
and the ratio of the second to the standalone row (the goal: at most 1.3).

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


def vllm_steps(model: Any, cfg: LlamaConfig) -> list[tuple[Any, ...]]:
    """The decode steps of `decode_steps` for vLLM's model: (attn_metadata, slot_mapping, input_ids, positions)."""
    from tests import vllm_real as real

    rng = random.Random(0)
    steps = []
    for n in range(BATCH, BATCH - 8, -1):
        step = real.Step([rng.randint(1, MAX_LEN) for _ in range(n)], [1] * n)
        metadata, slots = step.metadata(model)
        steps.append((metadata, slots, step.input_ids(model.config.model_config.get_vocab_size()), step.positions()))
    return steps


def time_vllm(model: Any, steps: list, rounds: int, calls: int) -> tuple[float, float]:
    """(best, median) us of thread CPU time per call of vLLM's model over `steps` in turn, each inside
    its forward context entered before the clock starts."""
    from vllm.forward_context import set_forward_context

    def one(step: tuple) -> float:
        metadata, slots, ids, positions = step
        with torch.no_grad(), set_forward_context(metadata, model.config, slot_mapping=slots):
            start = time.thread_time()
            model.model(ids, positions)
            return time.thread_time() - start

    for i in range(50):
        one(steps[i % len(steps)])
    gc.collect()
    gc.disable()
    try:
        times = [sum(one(steps[i % len(steps)]) for i in range(calls)) / calls * 1e6 for _ in range(rounds)]
    finally:
        gc.enable()
    return round(min(times), 1), round(statistics.median(times), 1)


def measure_vllm(layers: int, rounds: int, calls: int) -> dict[str, Any]:
    """The standalone direct + frozen row and the two vLLM rows at one depth, us per step (best, median)."""
    import os
    import tempfile

    from ascend_compile.integrations import vllm as integration
    from tests import vllm_real as real

    cfg = LlamaConfig(num_layers=layers, num_blocks=BATCH * MAX_LEN // 16)
    row: dict[str, Any] = {"layers": layers}
    with torch.no_grad():
        direct, _, _ = compiled_pair(cfg, frozen_parameters=True)
        row.update(time_rounds({"direct_frozen": lambda s: direct(**s)}, {"direct_frozen": decode_steps(cfg)},
                               rounds, calls))
        del direct
    original = integration.dynamo_backend.backend
    hf_config = {**real.TINY_LLAMA, "num_hidden_layers": layers, "max_position_embeddings": MAX_LEN}
    try:
        for name, dispatch in (("vllm_dynamo", "dynamo"), ("vllm_direct", "direct")):
            torch._dynamo.reset()
            artifacts: list = []
            integration.dynamo_backend.backend = lambda *a, **k: original(*a, on_compiled=artifacts.append, **k)
            os.environ["ASCEND_COMPILE_OPTIONS"] = json.dumps({"capture_sizes": [8, 16], "dispatch": dispatch})
            config = real.vllm_config(Path(tempfile.mkdtemp()), compile_mode=1, max_model_len=MAX_LEN,
                                      hf_config=hf_config)
            model = real.build(config, num_blocks=256)
            real.compile_as_vllm(model)
            real.profile_run(model, 16)
            steps = vllm_steps(model, cfg)
            time_vllm(model, steps[:2], 1, 2)  # the first compiled step, and the one that arms the route
            stub_device(artifacts[-1])
            row[name] = time_vllm(model, steps, rounds, calls)
            del model
    finally:
        integration.dynamo_backend.backend = original
        os.environ.pop("ASCEND_COMPILE_OPTIONS", None)
    row["direct/standalone"] = round(row["vllm_direct"][0] / row["direct_frozen"][0], 2)
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
    types = list(map(type, modules))
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
        "module types": lambda: list(map(type, modules)) == types,
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
    parser.add_argument("--vllm", action="store_true",
                        help="instead: vLLM's own Llama through the integration, dynamo and direct, beside the standalone row")
    parser.add_argument("--check-costs", action="store_true",
                        help="instead: us per call of dynamo's guard manager and of the direct checks that walk the model")
    args = parser.parse_args()
    if args.check_costs:
        for layers in args.layers:
            print(json.dumps({"layers": layers, **check_costs(layers)}), flush=True)
        return
    if args.vllm:
        print(f"host us per decode step, thread CPU time (batches {BATCH} to {BATCH - 7}, device stubbed), best / median "
              f"of {args.rounds} rounds of {args.calls} steps; vLLM {__import__('vllm').__version__}, torch "
              f"{torch.__version__}")
        measure_vllm(2, 3, 20)  # warm-up
        for layers in args.layers:
            row = measure_vllm(layers, args.rounds, args.calls)
            print(json.dumps(row) if args.json else
                  f"layers {layers}: standalone direct, frozen_parameters {row['direct_frozen'][0]} / {row['direct_frozen'][1]}"
                  f"; vLLM, dynamo {row['vllm_dynamo'][0]} / {row['vllm_dynamo'][1]}; vLLM, direct {row['vllm_direct'][0]}"
                  f" / {row['vllm_direct'][1]}; vLLM direct / standalone direct, frozen {row['direct/standalone']}",
                  flush=True)
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
