"""Random numbers inside captured graphs: a step that samples draws eager's tokens on every step.

A serving runtime's sampler ends the step with `torch.multinomial` on the logits. Seeded before
each step, the compiled step must draw exactly what eager draws, on the steps that capture a graph
as on those that replay one; and without re-seeding, consecutive replays must draw fresh numbers
from the generator, not the capture's.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import ascend_compile
from ascend_compile import CompileConfig, backend
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

CFG = LlamaConfig(num_layers=2, num_blocks=512)
MAX_LEN = 256
OPTIONS = dict(max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8, 16), pa_max_batch=4, runtime="sim")
#: 12 decode steps over batch sizes that fall in five buckets (1, 2, 4, 8, 16): five capture steps
SIZES = [3, 7, 3, 2, 12, 6, 4, 2, 9, 1, 5, 16]


class Sampler(nn.Module):
    """The example decoder with a serving runtime's sampler at the end: one token per sequence,
    drawn from the softmax of the logits (`[T, 1]` token ids)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.decoder = build(cfg)

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        logits = self.decoder(input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping)
        return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1)


def compiled_sampler(cfg: LlamaConfig = CFG, **options) -> tuple:
    """The sampler compiled once through the backend (on the simulator unless `options` say
    otherwise), its artifacts, and an identical eager sampler (same weights, its own KV cache)."""
    torch._dynamo.reset()
    artifacts: list = []
    config = CompileConfig(**{**OPTIONS, **options})
    fn = ascend_compile.compile(Sampler(cfg), backend=backend(config, on_compiled=artifacts.append))
    return fn, artifacts, Sampler(cfg)


def steps(cfg: LlamaConfig = CFG, sizes=SIZES, seed: int = 5):
    """The steps' inputs (decode, context lengths spread over the cache)."""
    batch = PagedBatch(cfg, seed=seed)
    for i, size in enumerate(sizes):
        yield batch.step([(37 * i + 11 * b) % (MAX_LEN - 1) + 1 for b in range(size)])


def seeded_mismatches(fn, reference, inputs_per_step) -> list[int]:
    """The steps at which `fn` drew other tokens than `reference`, both seeded alike before each."""
    mismatched = []
    with torch.no_grad():
        for i, inputs in enumerate(inputs_per_step):
            torch.manual_seed(1000 + i)
            expected = reference(**inputs)
            torch.manual_seed(1000 + i)
            if not torch.equal(fn(**inputs), expected):
                mismatched.append(i)
    return mismatched


def total(artifacts) -> collections.Counter:
    return sum((a.stats for a in artifacts), start=collections.Counter())


def test_seeded_sampling_matches_eager_on_capture_and_replay_steps():
    fn, artifacts, reference = compiled_sampler()
    mismatched = seeded_mismatches(fn, reference, steps())
    stats = total(artifacts)
    assert len(artifacts) == 1 and stats["eager_fallbacks"] == 0
    assert stats["captures"] == 5 and stats["replays"] == len(SIZES)  # every step replayed a graph
    assert not mismatched, f"steps {mismatched} drew other tokens than eager"


def test_seeded_sampling_matches_eager_on_steps_served_by_pieces():
    """Steps above the largest bucket go to piecewise graphs, captured on the live values of the step
    they are first used for (`lowering/piecewise_live.py`: each piece replayed once, the nodes between
    pieces run): that work draws nothing from the step's generator, so every step, the capturing ones
    included, draws eager's tokens."""
    fn, artifacts, reference = compiled_sampler(capture_sizes=(1, 2))
    mismatched = seeded_mismatches(fn, reference, steps(sizes=[5, 7, 3, 12, 5, 9]))
    stats = total(artifacts)
    assert stats["piecewise_steps"] == 6 and stats["eager_fallbacks"] == 0
    assert not mismatched, f"steps {mismatched} drew other tokens than eager"


def test_capture_step_leaves_the_generator_where_a_replay_step_does():
    """A capture draws nothing from the generator: seeded alike, the step that captures the graph
    and a later step that only replays it leave the generator in the same state. (Not eager's
    state: the graph draws for its padded bucket, so padding rows advance the generator too; the
    rows of the step's sequences are drawn exactly as eager draws them.)"""
    fn, artifacts, _ = compiled_sampler()
    inputs = next(steps())
    after = []
    with torch.no_grad():
        for _ in range(2):  # capture and replay, then replay only
            torch.manual_seed(7)
            fn(**inputs)
            after.append(torch.get_rng_state())
    assert total(artifacts)["captures"] == 1 and total(artifacts)["replays"] == 2
    assert torch.equal(after[0], after[1])


def test_replays_draw_fresh_numbers_without_reseeding():
    """One seed, then the same step replayed many times: the draws change from replay to replay
    (a replay draws from the generator as it is then, never the capture's numbers again)."""
    fn, artifacts, _ = compiled_sampler()
    inputs = next(steps())
    torch.manual_seed(11)
    with torch.no_grad():
        draws = [fn(**inputs).flatten().tolist() for _ in range(8)]
    assert total(artifacts)["replays"] == 8
    assert len({tuple(d) for d in draws}) > 1, f"every replay drew the same tokens {draws[0]}"


def test_one_seed_then_steps_at_bucket_sizes_draw_eager_s_stream():
    """Seeded once, then steps whose batch sizes are buckets (no padding rows to draw for): the
    compiled steps, capture steps included, draw the very stream of numbers eager steps draw."""
    fn, artifacts, reference = compiled_sampler()
    inputs = list(steps(sizes=[4, 8, 4, 2, 8, 4, 2]))
    with torch.no_grad():
        torch.manual_seed(21)
        expected = [reference(**step) for step in inputs]
        torch.manual_seed(21)
        got = [fn(**step) for step in inputs]
    assert total(artifacts)["captures"] == 3 and total(artifacts)["replays"] == len(inputs)
    assert [i for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)] == []


def test_seeded_sampling_matches_eager_on_npu_whose_warm_up_runs_the_step(monkeypatch):
    """On runtime "npu" (the fake torch_npu on the simulator) each capture is preceded by an eager
    warm-up run of the graph, which must not draw from the step's generators either."""
    fake_torch_npu.install(monkeypatch)
    # paged FIA on torch_npu: blocks of 128; PA and FIA there take half precision
    cfg = LlamaConfig(num_layers=1, num_blocks=64, block_size=128, dtype=torch.bfloat16)
    sizes = [3, 4, 7, 2, 8, 3]
    fn, artifacts, reference = compiled_sampler(cfg, runtime="npu", capture_sizes=(4, 8), max_model_len=512)
    mismatched = seeded_mismatches(fn, reference, steps(cfg, sizes))
    stats = total(artifacts)
    assert artifacts[0].runtime.name == "npu" and stats["captures"] == 2 and stats["replays"] == len(sizes)
    assert not mismatched, f"steps {mismatched} drew other tokens than eager"


def test_the_fake_npus_sampling_draws_from_its_own_generator(monkeypatch):
    """The fake torch_npu's NPU has a generator of its own, as torch_npu's do: `torch.multinomial`
    draws from it and leaves the CPU's alone, and `torch.manual_seed` seeds it too. So work that
    leaves only the CPU generator as it found it is told apart from work that leaves both."""
    fake_torch_npu.install(monkeypatch)
    probs = torch.full((4, 10), 0.1)
    torch.manual_seed(5)
    cpu = torch.get_rng_state()
    first = torch.multinomial(probs, 2)
    assert torch.equal(torch.get_rng_state(), cpu)
    after = torch.npu.get_rng_state()
    assert torch.equal(after, torch.npu.default_generators[0].get_state())
    torch.npu.manual_seed(5)
    assert torch.equal(torch.multinomial(probs, 2), first) and torch.equal(torch.npu.get_rng_state(), after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda_graphs_matches_eager_at_bucket_sizes():
    """Runtime "cuda": the default CUDA generator is registered with each graph, warm-up and capture
    leave it to the step, so seeded steps draw eager's tokens. Only at batch sizes that are buckets:
    CUDA's philox kernels map elements to (thread, draw) by the tensor's size (grid-stride loops), so
    a padded bucket draws other numbers for the same rows than an unpadded eager step."""
    pytest.importorskip("triton", reason="the CUDA kernels need triton")
    gpu = torch.device("cuda")
    torch._dynamo.reset()
    artifacts: list = []
    config = CompileConfig(**{**OPTIONS, "runtime": "auto", "capture_sizes": (4, 8)})
    fn = ascend_compile.compile(Sampler(CFG).to(gpu), backend=backend(config, on_compiled=artifacts.append))
    reference = Sampler(CFG).to(gpu)
    on_gpu = [{k: v.to(gpu) for k, v in inputs.items()} for inputs in steps(CFG, [4, 8, 4, 8, 4])]
    assert not seeded_mismatches(fn, reference, on_gpu)
    after = []
    with torch.no_grad():
        for _ in range(2):  # the graph of 4 is captured already: both replay; seeded alike, alike after
            torch.manual_seed(3)
            fn(**on_gpu[0])
            after.append(torch.cuda.get_rng_state())
    stats = total(artifacts)
    assert artifacts[0].runtime.name == "cuda" and stats["captures"] == 2 and stats["replays"] == 7
    assert torch.equal(after[0], after[1])
