"""How many graphs dynamo hands a backend for the example model stepped at every step shape.

    PYTHONPATH=. python tools/compile_count_experiments.py [--backend ascend|eager|both] [--only NAME]

Each setting compiles a fresh model, steps it through several orders of first-call shapes (decode
batch 1, 6, 40, a one-sequence mixed step, a multi-sequence mixed step), counts backend calls and
compares every output with eager. Prints one row per setting: compiles per order, and whether
every output matched.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import traceback

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from ascend_compile import CompileConfig, backend as ascend_backend
from examples.llama import LlamaConfig, PagedBatch, build

CFG = LlamaConfig(num_layers=2, num_blocks=512)
MAX_LEN = 256
TABLE_WIDTH = MAX_LEN // CFG.block_size

#: step name -> (context lens, query lens)
STEPS = {
    "d1": ([37], None),
    "d6": ([5, 80, 17, 250, 3, 64], None),
    "d40": ([(7 * i) % 200 + 2 for i in range(40)], None),
    "m1": ([45], [5]),
    "mN": ([30, 9, 100], [3, 1, 4]),
}
ORDERS = [
    ["d1", "d6", "d40", "m1", "mN"],
    ["d6", "d40", "d1", "m1", "mN"],
    ["m1", "d1", "d6", "mN", "d40"],
    ["mN", "d40", "d6", "d1", "m1"],
    ["d40", "mN", "m1", "d1", "d6"],
]

STEP_DIMS = {  # the step dims of each input: tokens T, sequences B, B + 1
    "input_ids": (0,), "positions": (0,), "slot_mapping": (0,),
    "block_table": (0,), "seq_lens": (0,), "query_start_loc": (0,),
}


def _marker(fn_name):
    """torch._dynamo.mark_dynamic / maybe_mark_dynamic; mark_unbacked lives in torch._dynamo.decorators."""
    return getattr(torch._dynamo.decorators, fn_name)


def mark(fn_name):
    def apply(inputs):
        fn = _marker(fn_name)
        for name, dims in STEP_DIMS.items():
            for d in dims:
                fn(inputs[name], d)
    return apply


def mark_all_dims(fn_name):
    def apply(inputs):
        fn = _marker(fn_name)
        for t in inputs.values():
            for d in range(t.dim()):
                fn(t, d)
    return apply


def mark_dim0(fn_name):
    """vLLM's rule: dim 0 of every tensor argument."""
    def apply(inputs):
        fn = _marker(fn_name)
        for t in inputs.values():
            fn(t, 0)
    return apply


@contextlib.contextmanager
def patched(**settings):
    """Patch torch._dynamo.config / torch.fx.experimental._config entries (prefix fx.)."""
    stack = contextlib.ExitStack()
    with stack:
        dyn = {k: v for k, v in settings.items() if not k.startswith("fx.")}
        fx = {k[3:]: v for k, v in settings.items() if k.startswith("fx.")}
        if dyn:
            stack.enter_context(torch._dynamo.config.patch(**dyn))
        if fx:
            stack.enter_context(fx_config.patch(**fx))
        yield


def drop_all_guards(entries):
    return [False for _ in entries]


def keep_only_shape_env_guards(entries):
    # keep the symbolic-shape guards (ranges, relations); drop the rest (tensor match, module attrs)
    return [e.guard_type == "SHAPE_ENV" for e in entries]


SETTINGS = {
    "default": dict(),
    "dynamic=True": dict(dynamic=True),
    "mark_dynamic(T,B,B+1)": dict(marker=mark("mark_dynamic")),
    "maybe_mark_dynamic(T,B,B+1)": dict(marker=mark("maybe_mark_dynamic")),
    "mark_unbacked(T,B,B+1)": dict(marker=mark("mark_unbacked")),
    "dynamic=True, use_duck_shape=False": dict(dynamic=True, config={"fx.use_duck_shape": False}),
    "dynamic=True, backed_size_oblivious": dict(dynamic=True, config={"fx.backed_size_oblivious": True}),
    "backed_size_oblivious (automatic dynamic)": dict(config={"fx.backed_size_oblivious": True}),
    "dynamic=True, bso, no duck": dict(dynamic=True, config={"fx.backed_size_oblivious": True,
                                                            "fx.use_duck_shape": False}),
    "assume_static_by_default=False": dict(config={"assume_static_by_default": False}),
    "assume_static=False, bso, no duck": dict(config={"assume_static_by_default": False,
                                                      "fx.backed_size_oblivious": True, "fx.use_duck_shape": False}),
    "automatic_dynamic_shapes=False": dict(config={"automatic_dynamic_shapes": False}),
    "automatic_dynamic_shapes_mark_as=unbacked": dict(config={"automatic_dynamic_shapes_mark_as": "unbacked"}),
    "mark_dynamic(T,B,B+1), no duck": dict(marker=mark("mark_dynamic"), config={"fx.use_duck_shape": False}),
    "mark_dynamic(T,B,B+1), bso": dict(marker=mark("mark_dynamic"), config={"fx.backed_size_oblivious": True}),
    "mark_dynamic(T,B,B+1), bso, no duck": dict(marker=mark("mark_dynamic"),
                                               config={"fx.backed_size_oblivious": True, "fx.use_duck_shape": False}),
    "maybe_mark_dynamic(T,B,B+1), bso, no duck": dict(marker=mark("maybe_mark_dynamic"),
                                                     config={"fx.backed_size_oblivious": True,
                                                             "fx.use_duck_shape": False}),
    "mark_unbacked(T,B,B+1), no duck": dict(marker=mark("mark_unbacked"), config={"fx.use_duck_shape": False}),
    "maybe_mark_dynamic(all dims), bso, no duck": dict(marker=mark_all_dims("maybe_mark_dynamic"),
                                                      config={"fx.backed_size_oblivious": True,
                                                              "fx.use_duck_shape": False}),
    "maybe_mark_dynamic(T,B,B+1), bso": dict(marker=mark("maybe_mark_dynamic"),
                                             config={"fx.backed_size_oblivious": True}),
    "assume_static=False, bso": dict(config={"assume_static_by_default": False, "fx.backed_size_oblivious": True}),
    "maybe_mark_dynamic(dim 0), bso, no duck": dict(marker=mark_dim0("maybe_mark_dynamic"),
                                                    config={"fx.backed_size_oblivious": True,
                                                            "fx.use_duck_shape": False}),
    "guard_filter_fn=drop all (default shapes)": dict(guard_filter_fn=drop_all_guards),
    "guard_filter_fn=drop all, dynamic=True": dict(dynamic=True, guard_filter_fn=drop_all_guards),
    "guard_filter_fn=drop all, mark_dynamic, bso, no duck": dict(
        marker=mark("mark_dynamic"), guard_filter_fn=drop_all_guards,
        config={"fx.backed_size_oblivious": True, "fx.use_duck_shape": False}),
    "guard_filter_fn=shape_env only, mark_dynamic, bso, no duck": dict(
        marker=mark("mark_dynamic"), guard_filter_fn=keep_only_shape_env_guards,
        config={"fx.backed_size_oblivious": True, "fx.use_duck_shape": False}),
}


def make_backend(kind, count):
    inner = (ascend_backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8, 16, 32, 64),
                                          pa_max_batch=4, runtime="sim"))
             if kind == "ascend" else (lambda gm, ex: gm.forward))

    def counting(gm, example_inputs):
        shapes = [tuple(getattr(x, "shape", ())) for x in example_inputs if isinstance(x, torch.Tensor)]
        count.append([tuple(str(d) for d in s) for s in shapes if len(s) <= 2])
        return inner(gm, example_inputs)

    return counting


def run_order(kind, setting, order, table_width):
    torch._dynamo.reset()
    model, reference = build(CFG), build(CFG)
    count = []
    kwargs = {}
    if "dynamic" in setting:
        kwargs["dynamic"] = setting["dynamic"]
    options = {}
    if "guard_filter_fn" in setting:
        options["guard_filter_fn"] = setting["guard_filter_fn"]
    fn = torch.compile(model, backend=make_backend(kind, count), options=options or None, **kwargs)
    batch = PagedBatch(CFG, seed=3, table_width=table_width)
    ok = True
    with torch.no_grad(), patched(**setting.get("config", {})):
        for name in order:
            lens, qlens = STEPS[name]
            inputs = batch.step(lens, qlens)
            if "marker" in setting:
                setting["marker"](inputs)
            out = fn(**inputs)
            ref = reference(**inputs)
            if out.shape != ref.shape or not torch.allclose(out, ref, atol=2e-5, rtol=1e-4):
                ok = False
    return len(count), ok, count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="both", choices=["ascend", "eager", "both"])
    parser.add_argument("--only", default=None, help="substring of the setting names to run")
    parser.add_argument("--table-width", default="fixed", choices=["fixed", "varying"])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    kinds = ["eager", "ascend"] if args.backend == "both" else [args.backend]
    width = TABLE_WIDTH if args.table_width == "fixed" else None
    print(f"torch {torch.__version__}; block table width {args.table_width}; orders:")
    for i, order in enumerate(ORDERS):
        print(f"  {chr(65 + i)}: {' '.join(order)}")
    for name, setting in SETTINGS.items():
        if args.only and args.only not in name:
            continue
        for kind in kinds:
            cells = []
            for i, order in enumerate(ORDERS):
                try:
                    n, ok, count = run_order(kind, setting, order, width)
                    cells.append(f"{chr(65 + i)}={n}{'' if ok else '!WRONG'}")
                    if args.verbose:
                        print(f"    {name} {kind} {chr(65 + i)}: {count}")
                except Exception as e:  # noqa: BLE001 - reported in the table
                    cells.append(f"{chr(65 + i)}=ERR({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                    if args.verbose:
                        traceback.print_exc()
            print(f"{name:58s} {kind:6s} {'  '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
