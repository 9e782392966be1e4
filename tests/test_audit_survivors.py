"""The bugs a mutation audit (issue 27) put into the code and the suite let through, each now caught by
what a user sees: eager equality, the exact workspace maximum, a refusal. `tools/mutants.py` puts each
back and requires it caught. The property tests below each cover the class the survivor belonged to:
a check run on one branch only, a limit tested on one side, a cache keyed by part of what it depends on.
"""
from __future__ import annotations

import pytest
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_compile.ops import tiling
from ascend_compile.passes import roles
from ascend_compile.passes.write_back import overlapping_writes
from ascend_compile.torch_support import torch_release
from examples.llama import LlamaConfig, PagedBatch, build
from tests.test_backend import compiled_model
from tests.test_runtime_graphs import BUF, Caller, TinyStep, compiled, dynamic_artifact, int_buffer, make_step, \
    run_both

# ------------------------------------------------ 1: several writes into one buffer, overlapping when padded


def test_a_write_overlapping_an_earlier_one_only_when_padded_runs_eagerly():
    """Three writes into one buffer: the third, padded, overlaps the second (not the first). Every
    write's elements count against the later ones, or the third's padded rows would land on the
    second's real ones and be copied back into the caller's buffer."""
    body = "buf[0, :n].copy_(tokens)\nbuf[1, 6:6 + n].copy_(tokens + 100)\nbuf[1, :n].copy_(tokens)\nreturn logits"
    artifacts = run_both(body, int_buffer((2, 40)), [3, 5, 6, 3, 4], dynamic=True)
    art = dynamic_artifact(artifacts)
    assert art.signature.pad_reason is None
    # 5 and 6 tokens: bucket 8 pads the third write over the second; piecewise, each write runs on the
    # caller's buffer itself, between the pieces
    assert art.stats["piecewise_steps"] == 2 and art.stats["eager_fallbacks"] == 0
    assert any("overlapping" in why and "b8" in why for why in art._fallbacks_logged)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 12), st.integers(1, 6)),
                min_size=1, max_size=5))
def test_overlapping_writes_finds_every_clash_with_any_earlier_write(writes):
    """Views of three buffers (rows, column ranges): a write clashes where it shares an element with
    any earlier write into the same buffer, whichever earlier one that is."""
    buffers = [torch.zeros(3, 20) for _ in range(3)]
    views = [buffers[b][row, start:start + length] for b, row, start, length in writes]
    expected = [b for i, (b, row, start, length) in enumerate(writes)
                if any(b2 == b and r2 == row and s2 < start + length and start < s2 + l2
                       for b2, r2, s2, l2 in writes[:i])]
    assert overlapping_writes(views, [b for b, *_ in writes]) == expected


# ------------------------------------------------ 2: a written region that shrinks as the step grows


def test_clearing_the_rest_of_a_buffer_is_captured_per_exact_size():
    """`buf[0, n:].fill_(-1)` ("clear the rest") writes a region that shrinks as the step grows: a
    padded step's region is not the real one's prefix, so the graph is captured per size."""
    body = "buf[0, :n].copy_(tokens)\nbuf[0, n:].fill_(-1)\nreturn logits"
    artifacts = run_both(body, int_buffer((1, BUF)), [3, 5, 2, 7, 3], dynamic=True)
    art = dynamic_artifact(artifacts)
    assert "does not grow with the step" in art.signature.pad_reason
    assert art.stats["replays"] >= 3


_N, _M = sympy.symbols("n m", integer=True, positive=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=4, max_size=4), st.integers(1, 8), st.integers(1, 8))
def test_a_size_said_to_grow_never_shrinks(coefficients, n, m):
    """Soundness of `_grows` over polynomials in two sizes: where it says a size grows with the step,
    growing either size never makes it smaller."""
    a, b, c, d = coefficients
    expr = a * _N + b * _M + c * _N * _M + d
    if roles._grows(expr):
        value = lambda x, y: int(expr.subs({_N: x, _M: y}))  # noqa: E731
        assert value(n + 1, m) >= value(n, m) and value(n, m + 1) >= value(n, m), expr


# ------------------------------------------------ 4: a host scalar changed while no address moved


class ScaledStep(TinyStep):
    """Logits divided by a temperature, a 0-d CPU tensor the caller passes (a host scalar)."""

    def forward(self, ids, positions, block_table, seq_lens, query_start_loc, slot_mapping, temperature):
        return self.logits(ids, positions, block_table, seq_lens, query_start_loc, slot_mapping) / temperature


def test_a_changed_host_scalar_is_not_replayed_with_its_capture_value():
    torch._dynamo.reset()
    fn, artifacts = compiled(ScaledStep(), dynamic=True)
    reference = ScaledStep()
    caller = Caller(0)
    with torch.no_grad():
        for temperature in (1.0, 1.0, 0.5, 2.0, 2.0):
            inputs = caller.step(3)
            t = torch.tensor(temperature)
            torch.testing.assert_close(fn(**inputs, temperature=t), reference(**inputs, temperature=t))
    art = dynamic_artifact(artifacts)
    assert art.stats["recaptures"] == 2 and art.stats["replays"] == 5


# ------------------------------------------------ 5: hoisted metadata differing in a keyword argument


class TwoWindowsStep(TinyStep):
    """Two attention calls whose KV lengths the model derives from the same cumulative lengths,
    clamped to two different limits (keyword arguments): two hoisted metadata values, not one."""

    def forward(self, ids, positions, block_table, cu_seq_lens_q, cu_seq_lens_k, slot_mapping):
        lens = torch.diff(cu_seq_lens_k)
        near = torch.clamp(lens, max=8).to(torch.int32)
        far = torch.clamp(lens, max=24).to(torch.int32)
        x = self.embed[ids] + positions.unsqueeze(-1).float() * 0.01
        q = x.view(x.shape[0], 2, 8)
        kv = q[:, :1].contiguous()
        torch.ops.ascend.reshape_and_cache(kv, kv, self.key_cache, self.value_cache, slot_mapping)
        scale = 8 ** -0.5
        a = torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, near, cu_seq_lens_q, scale)
        b = torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, far, cu_seq_lens_q, scale)
        return (a + 2 * b).reshape(x.shape[0], -1) @ self.out


def test_metadata_differing_only_in_a_keyword_argument_is_not_merged():
    torch._dynamo.reset()
    fn, artifacts = compiled(TwoWindowsStep())
    reference = TwoWindowsStep()
    caller = Caller(1)
    with torch.no_grad():
        for size in (3, 5, 2, 4):
            raw = caller.step(size)
            cu_k = torch.tensor([0] + raw["seq_lens"].tolist()).cumsum(0).to(torch.int32)
            inputs = dict(ids=raw["ids"], positions=raw["positions"], block_table=raw["block_table"],
                          cu_seq_lens_q=raw["query_start_loc"], cu_seq_lens_k=cu_k, slot_mapping=raw["slot_mapping"])
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    art = dynamic_artifact(artifacts)
    assert len(art.rewritten.prologue.names) == 2 and art.stats["replays"] >= 3


# ------------------------------------------------ 9 and 12: outputs per sequence; sequences with no query


PER_SEQUENCE = "return logits, logits[(query_start_loc[1:] - 1).clamp(min=0)]"


def per_sequence_steps(body: str, steps: list[tuple[list[int], list[int]]], runtime: str = "sim") -> list:
    """Run `steps` ((KV lengths, query lengths) each) compiled and eager; every output equal."""
    torch._dynamo.reset()
    fn, artifacts = compiled(make_step(body), dynamic=True, runtime=runtime)
    reference = make_step(body)
    batch = PagedBatch(LlamaConfig(vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                                   num_blocks=256), seed=4, table_width=16)
    with torch.no_grad():
        for i, (lens, qlens) in enumerate(steps):
            raw = batch.step(lens, qlens)
            inputs = {"ids": raw["input_ids"], "positions": raw["positions"], "block_table": raw["block_table"],
                      "seq_lens": raw["seq_lens"], "query_start_loc": raw["query_start_loc"],
                      "slot_mapping": raw["slot_mapping"]}
            a, b = torch.zeros(1, BUF, dtype=torch.int64), torch.zeros(1, BUF, dtype=torch.int64)
            for got, expected in zip(fn(**inputs, buf=a), reference(**inputs, buf=b)):
                assert got.shape == expected.shape, f"step {i} {qlens}: {got.shape} != {expected.shape}"
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} {qlens}: {m}")
    return artifacts


def test_outputs_sized_by_the_sequence_count_follow_it_when_the_token_count_repeats():
    """Logits at each sequence's last token are `[B, V]`: two steps of 6 tokens with 3 and then 2
    sequences return 3 and 2 rows."""
    artifacts = per_sequence_steps(PER_SEQUENCE, [([9, 9, 9], [2, 2, 2]), ([9, 9], [3, 3]), ([9, 9, 9], [2, 2, 2])])
    assert sum(a.stats["replays"] for a in artifacts) == 3


def test_a_sequence_with_no_query_tokens_is_not_served_as_decode():
    """As many tokens as sequences, but one sequence has none and another two (a padded request beside
    a chunk): a mixed step, not a decode one."""
    artifacts = per_sequence_steps("return logits", [([9, 9, 9], [1, 1, 1]), ([9, 9, 9], [2, 0, 1]),
                                                     ([9, 9, 9], [1, 1, 1])])
    keys = {str(g.key) for a in artifacts for g in a.graphs.values() if g.graph is not None}
    assert any(k.endswith(".mixed") for k in keys), keys


class _Pair:
    """One compiled step function and its eager twin, built once for the property test below."""

    def __init__(self) -> None:
        torch._dynamo.reset()
        self.fn, self.artifacts = compiled(make_step(PER_SEQUENCE), dynamic=True)
        self.reference = make_step(PER_SEQUENCE)
        self.batch = PagedBatch(LlamaConfig(vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                                            num_blocks=256), seed=5, table_width=16)


_PAIR: list[_Pair] = []


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=4))
def test_random_steps_with_empty_and_chunked_sequences_equal_eager(steps):
    """Steps of 1-5 sequences of 0-3 query tokens each, in any order, through one artifact: every
    output (per token and per sequence) equals eager's, whatever step shapes came before."""
    if not _PAIR:
        _PAIR.append(_Pair())
    pair = _PAIR[0]
    with torch.no_grad():
        for qlens in steps:
            if not sum(qlens):
                continue
            raw = pair.batch.step([q + 5 for q in qlens], qlens)
            inputs = {"ids": raw["input_ids"], "positions": raw["positions"], "block_table": raw["block_table"],
                      "seq_lens": raw["seq_lens"], "query_start_loc": raw["query_start_loc"],
                      "slot_mapping": raw["slot_mapping"]}
            a, b = torch.zeros(1, BUF, dtype=torch.int64), torch.zeros(1, BUF, dtype=torch.int64)
            for got, expected in zip(pair.fn(**inputs, buf=a), pair.reference(**inputs, buf=b)):
                assert got.shape == expected.shape, (qlens, got.shape, expected.shape)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------ 11: a sequence of exactly max_model_len


@pytest.mark.parametrize("policy, max_len, steps", [
    ("pa", 257, [([257, 10, 3], None)]),  # PA takes a second split just past 256
    ("fia", 1025, [([1025, 7], [2, 1]), ([1025, 1025], None)]),  # FIA's second split starts at 1025
])
def test_a_sequence_of_exactly_max_model_len_fits_its_workspace(policy, max_len, steps):
    cfg = LlamaConfig(num_layers=1, num_blocks=300, block_size=16)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=max_len, capture_sizes=(4,), kernel_policy=policy,
                                   sim_overflow="raise")
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([tiling.PA, tiling.FIA]), st.integers(1, 5000))
def test_the_workspace_maximum_is_the_brute_force_maximum_up_to_max_model_len(kernel, max_len):
    shape = tiling.AttentionShape(4, 2, 16, 16)
    brute = max(tiling.workspace_nbytes(kernel, shape, [n]) for n in range(1, max_len + 1))
    assert tiling.max_uniform_workspace(kernel, shape, 3, max_len).nbytes == 3 * brute
    assert tiling.max_workspace(kernel, shape, 1, max_len).nbytes == brute  # one sequence: no mix


# ------------------------------------------------ 6: transformers' block table at max_model_len


@pytest.mark.skipif(torch_release() < (2, 11), reason="continuous batching is refused before torch 2.11")
def test_transformers_sequences_up_to_a_max_model_len_off_the_page_size_keep_their_last_page():
    """max_model_len 40 with pages of 16: a sequence reaching 40 tokens spans 3 pages; its block
    table must be 3 wide (40 / 16 rounded up), or attention never reads its last page."""
    transformers = pytest.importorskip("transformers")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from ascend_compile.integrations import transformers as ac_hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=40)).eval()
    prompts = [[1 + (j * 5) % 120 for j in range(34)], [3, 9, 27]]
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   generation_config=greedy)[0, len(p):].tolist() for p in prompts]
    torch._dynamo.reset()
    artifacts: list = []
    cb = ac_hf.continuous_batching(model, ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=16),
                                   on_compiled=artifacts.append, capture_sizes=[1, 2, 4, 8, 16])
    outputs = model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=cb)
    got = [outputs[k].generated_tokens for k in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    assert got == expected
    assert sum(a.stats["replays"] for a in artifacts) >= 4


# ------------------------------------------------ 3: the KV lengths padding sequences are sent


def test_padding_sequences_are_sent_their_query_length_as_kv_length(monkeypatch):
    """What the kernels receive for padding sequences: a KV length equal to the sequence's query
    length, at least 1. torch_npu 2.14's FIA docs allow any non-negative length up to KV_S
    (`_op_plugin_docs.py`, actual_seq_lengths_kv), but say nothing of the output of an entry of length
    0, which only the kernels' zero-init path covers; a length of at least the query's keeps every
    causal row of a padding sequence attending one key (block 0 of its all-zero block-table row)."""
    from ascend_compile.runtime.sim.launch import Launcher

    sent: list[tuple[str, list[int], list[int]]] = []
    launch = Launcher.launch

    def spy(self, op, args, kwargs, label, capturing):
        if op is torch.ops.ascend.paged_attention.default:
            sent.append(("pa", [], list(args[4])))
        elif op is torch.ops.ascend.fused_infer_attention.default:
            sent.append(("fia", list(args[4]), list(args[5])))
        return launch(self, op, args, kwargs, label, capturing)

    monkeypatch.setattr(Launcher, "launch", spy)
    cfg = LlamaConfig(num_layers=1, num_blocks=300)
    fn, artifacts = compiled_model(build(cfg), max_model_len=256, capture_sizes=(4, 8), pa_max_batch=4)
    batch = PagedBatch(cfg, seed=3)
    steps = []
    with torch.no_grad():
        for lens, qlens in (([40, 50, 60], None), ([40, 50], None), ([40, 50], None), ([20, 30], [2, 3]),
                            ([20, 30], [2, 3])):
            sent.clear()
            fn(**batch.step(lens, qlens))
            steps.append(list(sent))
    # a replayed decode (the first step has dynamo's static graph): 2 sequences in bucket 4 (PA)
    assert steps[2] == [("pa", [], [40, 50, 1, 1])]
    # a replayed mixed step: 5 tokens in bucket 8, its 3 padded tokens in one dummy sequence of KV 3
    assert steps[4] == [("fia", [2, 5, 8], [20, 30, 3])]
    assert sum(a.stats["replays"] for a in artifacts) == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["same", "moved", "changed"]), min_size=1, max_size=6), st.integers(0, 5))
def test_captured_inputs_report_every_moved_input_and_changed_scalar(changes, tensors):
    """Whatever mix of moved in-place inputs and changed host scalars a step brings (either alone,
    both, neither), every one is reported, and nothing else."""
    from ascend_compile.lowering.input_checks import CapturedInputs

    tensors = min(tensors, len(changes))
    kinds = ["tensor"] * tensors + ["scalar"] * (len(changes) - tensors)
    args = [torch.zeros(2) if kind == "tensor" else torch.tensor(float(i)) for i, kind in enumerate(kinds)]
    captured = CapturedInputs(args, [i for i, k in enumerate(kinds) if k == "tensor"],
                              [i for i, k in enumerate(kinds) if k == "scalar"])
    step, expected = list(args), []
    for i, (kind, change) in enumerate(zip(kinds, changes)):
        if change == "moved" and kind == "tensor":
            step[i] = torch.zeros(2)
            expected.append(i)
        elif change == "changed" and kind == "scalar":
            step[i] = torch.tensor(float(i) + 0.5)
            expected.append(i)
    assert sorted(captured.changed(step)) == sorted(expected)
