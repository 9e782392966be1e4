"""One backend compile per model for every step shape (`ascend_compile.compile_once`).

Each order starts from another first-call shape: decode batch 1, 6 and 40, a one-sequence mixed
step (a prefill chunk) and a mixed step of several sequences. Whatever comes first, the backend
is called once and every step matches eager.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.fx.experimental._config as fx_config

import ascend_compile
from ascend_compile import CompileConfig, backend, compile_once
from examples.llama import LlamaConfig, PagedBatch, build

CFG = LlamaConfig(num_layers=1, num_blocks=256)
MAX_LEN = 256
OPTIONS = dict(max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8, 16, 32, 64), pa_max_batch=4, runtime="sim")

#: name -> (context lengths, query lengths)
STEPS = {
    "decode1": ([37], None),
    "decode6": ([5, 80, 17, 250, 3, 64], None),
    "decode40": ([(7 * i) % 200 + 2 for i in range(40)], None),
    "mixed1": ([45], [5]),
    "mixed": ([30, 9, 100], [3, 1, 4]),
}
ORDERS = [
    ["decode1", "decode6", "mixed1", "decode40", "mixed"],
    ["decode6", "decode1", "mixed", "mixed1", "decode40"],
    ["decode40", "mixed1", "decode1", "mixed", "decode6"],
    ["mixed1", "decode40", "mixed", "decode1", "decode6"],
    ["mixed", "decode6", "decode40", "mixed1", "decode1"],
]


def counting(compile_fn, calls):
    def count(gm, example_inputs):
        calls.append(gm)
        return compile_fn(gm, example_inputs)
    return count


def run_steps(fn, reference, order, table_width):
    batch = PagedBatch(CFG, seed=3, table_width=table_width)
    with torch.no_grad():
        for name in order:
            lens, query_lens = STEPS[name]
            inputs = batch.step(lens, query_lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("order", ORDERS, ids=[o[0] + "_first" for o in ORDERS])
def test_helper_compiles_once_for_every_step_shape(order):
    torch._dynamo.reset()
    model, reference = build(CFG), build(CFG)
    calls, artifacts = [], []
    fn = ascend_compile.compile(model, backend=counting(backend(CompileConfig(**OPTIONS),
                                                                on_compiled=artifacts.append), calls))
    run_steps(fn, reference, order, table_width=None)  # block-table widths vary too
    assert len(calls) == 1 and len(artifacts) == 1
    stats = artifacts[0].stats
    assert stats["eager_fallbacks"] == 0 and stats["replays"] + stats["captures"] >= len(order)
    # the settings are put back after every call
    assert not fx_config.backed_size_oblivious and fx_config.use_duck_shape
    assert torch._dynamo.config.assume_static_by_default


def test_helper_through_the_registered_backend_name(monkeypatch):
    torch._dynamo.reset()
    calls = []
    backend_module = importlib.import_module("ascend_compile.backend")
    original = backend_module.compile_graph

    def compile_graph(gm, example_inputs, config):
        calls.append(gm)
        return original(gm, example_inputs, config)

    monkeypatch.setattr(backend_module, "compile_graph", compile_graph)
    model, reference = build(CFG), build(CFG)
    fn = ascend_compile.compile(model, options=dict(OPTIONS))
    run_steps(fn, reference, ORDERS[0], table_width=MAX_LEN // CFG.block_size)
    assert len(calls) == 1


def test_backend_alone_retraces_a_static_first_graph():
    """`retrace_static`: plain torch.compile, the backend has dynamo trace the first call again.
    (Without it, the same steps hand the backend 3 to 4 graphs: tools/compile_count_experiments.py.)"""
    torch._dynamo.reset()
    model, reference = build(CFG), build(CFG)
    calls, artifacts = [], []
    compile_fn = backend(CompileConfig(retrace_static=True, **OPTIONS), on_compiled=artifacts.append)
    fn = torch.compile(model, backend=counting(compile_fn, calls))
    run_steps(fn, reference, ORDERS[0], table_width=None)
    assert len(artifacts) == 1  # one compile
    assert len(calls) == 2  # the first, static graph was only traced: the backend asked for the retrace
    assert not fx_config.backed_size_oblivious and fx_config.use_duck_shape
    assert torch._dynamo.config.assume_static_by_default


def test_backend_alone_keeps_static_shapes_when_asked():
    torch._dynamo.reset()
    model = build(CFG)
    artifacts = []
    compile_fn = backend(CompileConfig(retrace_static=True, **OPTIONS), on_compiled=artifacts.append)
    fn = torch.compile(model, backend=compile_fn, dynamic=False)
    batch = PagedBatch(CFG, seed=3)
    with torch.no_grad():
        fn(**batch.step([5, 9]))
    assert len(artifacts) == 1 and artifacts[0].signature.is_static


def test_specialized_inputs_names_the_callers_static_tensors():
    seen = []

    def record(gm, example_inputs):
        seen.append(compile_once.specialized_inputs(gm))
        return gm.forward

    batch = PagedBatch(CFG, seed=3)
    for general in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(build(CFG), backend=record)
        with torch.no_grad(), (compile_once.trace_settings() if general else torch.no_grad()):
            fn(**batch.step([5, 9]))
    assert sorted(seen[0]) == sorted(["l_input_ids_", "l_positions_", "l_block_table_", "l_seq_lens_",
                                      "l_query_start_loc_", "l_slot_mapping_"])
    assert seen[1] == []  # parameters and buffers are never listed


class RowTokens(torch.nn.Module):
    """The example model taking `[1, T]` token ids and positions, as some runtimes pass them."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        return self.model(input_ids.reshape(-1), positions.reshape(-1), block_table, seq_lens, query_start_loc,
                          slot_mapping)


def test_named_step_dims_for_row_token_inputs():
    """`[1, T]` inputs: only the named dims are symbolic, so the token count stays one size and steps are padded."""
    torch._dynamo.reset()
    model, reference = RowTokens(build(CFG)), RowTokens(build(CFG))
    calls, artifacts = [], []
    step_dims = {"input_ids": 1, "positions": 1, "block_table": (0, 1), "seq_lens": 0, "query_start_loc": 0,
                 "slot_mapping": 0}
    fn = ascend_compile.compile(model, backend=counting(backend(CompileConfig(**OPTIONS), on_compiled=artifacts.append),
                                                        calls), step_dims=step_dims)
    batch = PagedBatch(CFG, seed=3)
    with torch.no_grad():
        for name in ORDERS[0]:
            inputs = batch.step(*STEPS[name])
            inputs["input_ids"], inputs["positions"] = inputs["input_ids"][None], inputs["positions"][None]
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert len(calls) == 1
    signature = artifacts[0].signature
    assert signature.pad_reason is None and "tokens" in {k.value for k in signature.symbol_kinds.values()}
    assert artifacts[0].stats["eager_fallbacks"] == 0
