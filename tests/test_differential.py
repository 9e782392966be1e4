"""The differential tester: random models, options, steps and user actions, every step and every cache
compared with the same model run eagerly.

A hypothesis state machine (`Differential`) draws a setup — a small model (dense MHA/GQA/MQA, sliding
windows on some layers so PA and FIA layers share a graph, logit soft-caps, sinks, or DeepSeek's
latent attention), backend options drawn from the options table, a dispatch mode and a target (the
simulator, or runtime "npu" on the fake torch_npu) — then runs random rules against the compiled model
and an eager twin built from the same seed:

The setup also draws how the user reaches the backend: `ascend_compile.compile` (dispatch "dynamo" or
"direct"), or `torch.compile(backend="ascend_graph")` with or without `dynamic=True`.

- decode steps (one query token a sequence) of any batch, below, between and above the buckets;
- mixed steps: several query tokens for some sequences, none for others, a prefill chunk beside
  decodes, token counts above the largest bucket;
- a new KV cache (every cache buffer assigned a new tensor, as a runtime that re-allocates does);
- weights loaded in place (`copy_` into every parameter, as a weight reload does).

After each step the outputs and every buffer (the caches) must equal eager's within the tolerances
`verify` uses (`lowering/verify.py`). A step on a valid input must not raise; a setup the target
refuses at compile time must be refused with an error naming the layer, leaving every cache as it
was. Tensor parallelism is not drawn here (it needs a process per rank: `tests/test_tensor_parallel.py`).

Profiles (`HYPOTHESIS_PROFILE`): "ci" (the default: a fixed seed, a few examples, within the CI
budget) and "long" (`HYPOTHESIS_PROFILE=long python -m pytest tests/test_differential.py`, hundreds of
examples, about an hour on two cores). Failing examples are saved to `tests/hypothesis-db/`, which is
committed, so every run first replays what earlier runs found.
"""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import ascend_compile
from ascend_compile.errors import AscendCompileError
from examples import deepseek
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

DATABASE = DirectoryBasedExampleDatabase(str(Path(__file__).parent / "hypothesis-db"))
COMMON = dict(database=DATABASE, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("ci", max_examples=6, stateful_step_count=8, derandomize=False, **COMMON)
settings.register_profile("long", max_examples=300, stateful_step_count=25, **COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
#: The CI profile's seed: its examples are the same in every run (besides the database's).
SEED = 20261201

KERNEL_POLICIES = ("pa_max_batch", "pa_batch_sizes", "auto", "pa", "fia")
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
#: How a user reaches the backend: the one-compile helper, or torch.compile itself (static first trace,
#: then whatever dynamo decides), or torch.compile with every size dynamic.
ENTRIES = ("compile", "compile", "torch.compile", "torch.compile(dynamic=True)")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One drawn example: the model, its options, the dispatch mode and the target."""

    model: str  # "dense" or "mla"
    runtime: str  # "sim" or "npu" (the fake torch_npu)
    entry: str  # "compile" (ascend_compile.compile), "torch.compile", "torch.compile(dynamic=True)"
    dispatch: str  # "dynamo" or "direct" (ascend_compile.compile only)
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    block_size: int
    max_model_len: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    soft_cap: float | None
    sinks: bool
    sample: bool  # the step ends in a sampler's random draws (`Sampled`)
    options: tuple[tuple[str, Any], ...]

    @property
    def max_bucket(self) -> int:
        return max(dict(self.options)["capture_sizes"])


@st.composite
def setups(draw) -> Setup:
    runtime = draw(st.sampled_from(("sim", "npu")))
    model = draw(st.sampled_from(("dense", "dense", "mla")))
    num_layers = draw(st.integers(1, 2))
    # paged FIA on torch_npu takes block sizes that are multiples of 128 (tests/fake_torch_npu.py)
    block_size = 128 if runtime == "npu" else draw(st.sampled_from((8, 16, 32)))
    max_model_len = draw(st.integers(block_size // 2, 3 * block_size + 5))
    # the features on runtime "npu" (windows, sinks; the soft-cap refused) are tests/test_npu_features.py's
    features = model == "dense" and runtime == "sim"
    sliding = features and draw(st.booleans())
    layer_types = tuple(draw(st.sampled_from(("sliding", "full"))) for _ in range(num_layers)) if sliding else ()
    capture_sizes = tuple(sorted(draw(st.sets(st.sampled_from(BUCKETS), min_size=1, max_size=4))))
    policy = draw(st.sampled_from(KERNEL_POLICIES))
    options: dict[str, Any] = dict(
        capture_sizes=capture_sizes,
        max_model_len=max_model_len,
        save_cache_rows=True,  # a step that raises must leave every cache as before (`step`)
        runtime=runtime,
        kernel_policy=policy,
        capture_all=draw(st.booleans()),
        share_workspace=draw(st.booleans()),
        frozen_parameters=draw(st.booleans()),
        verify=draw(st.sampled_from((None, True, False))),
        clone_outputs=draw(st.booleans()),
    )
    if runtime == "sim":  # a kernel short of workspace raises, not writes past it unseen (the fake checks its own)
        options["sim_overflow"] = "raise"
    if policy == "pa_max_batch":
        options["pa_max_batch"] = draw(st.integers(1, 8))
    if policy == "pa_batch_sizes":
        options["pa_batch_sizes"] = tuple(draw(st.sets(st.sampled_from(capture_sizes), min_size=1)))
    entry = draw(st.sampled_from(ENTRIES))
    return Setup(
        model=model, runtime=runtime, entry=entry,
        # torch_npu's kernels take float16 / bfloat16 (passes/npu_checks.py); the simulator any float
        dtype=draw(st.sampled_from((torch.bfloat16, torch.float16) if runtime == "npu" else
                                   (torch.float32, torch.float32, torch.bfloat16))),
        dispatch=draw(st.sampled_from(("dynamo", "direct"))) if entry == "compile" else "dynamo", num_layers=num_layers,
        num_kv_heads=draw(st.sampled_from((4, 2, 1))), block_size=block_size, max_model_len=max_model_len,
        layer_types=layer_types, sliding_window=draw(st.integers(1, 40)) if sliding else None,
        soft_cap=draw(st.sampled_from((None, 5.0))) if features else None,
        sinks=features and draw(st.booleans()), sample=draw(st.booleans()), options=tuple(options.items()),
    )


class Sampled(torch.nn.Module):
    """A model whose step also returns a sampler's random draws: one `torch.multinomial` draw per token
    (of a uniform choice, so that a draw never depends on logits within tolerance of eager's), from the
    device's generator (on the fake torch_npu the NPU's own). Seeded alike before each step, the
    compiled step must draw exactly eager's numbers, on capture steps as on replays."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        logits = self.model(**inputs)
        return logits, torch.multinomial(torch.ones(logits.shape[0], 16, device=logits.device), 2)


def build_pair(setup: Setup) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(compiled-to-be model, eager twin, the model config) from one seed."""
    model, twin, cfg = _build_pair(setup)
    return (Sampled(model), Sampled(twin), cfg) if setup.sample else (model, twin, cfg)


def _build_pair(setup: Setup) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    if setup.model == "mla":
        # FIA v2's MLA form takes kv_lora_rank 512 and rope dim 64 (tests/test_mla_npu.py)
        cfg = deepseek.DeepSeekConfig(num_layers=setup.num_layers, hidden_size=32, num_heads=4, kv_lora_rank=512,
                                      qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, ffn_size=32,
                                      block_size=setup.block_size, num_blocks=96, dtype=setup.dtype)
        return deepseek.build(cfg, seed=5), deepseek.build(cfg, seed=5), cfg
    cfg = LlamaConfig(num_layers=setup.num_layers, hidden_size=32, num_heads=4, num_kv_heads=setup.num_kv_heads,
                      head_dim=16, ffn_size=32, block_size=setup.block_size, num_blocks=96,
                      sliding_window=setup.sliding_window, layer_types=setup.layer_types, soft_cap=setup.soft_cap,
                      sinks=setup.sinks, dtype=setup.dtype)
    model, twin = build(cfg, seed=5), build(cfg, seed=5)
    if setup.sinks:
        with torch.no_grad():
            for a, b in zip(model.modules(), twin.modules()):
                if getattr(a, "sinks", None) is not None:
                    a.sinks.uniform_(-1, 1, generator=torch.Generator().manual_seed(9))
                    b.sinks.copy_(a.sinks)
    return model, twin, cfg


#: (rtol, atol) per dtype, element by element: the simulator's kernels and eager round alike on these
#: shallow models, so the tester holds them to every element (stricter than `verify`'s per-row rule,
#: which must pass a device's kernels on deep models).
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float64: (1e-6, 1e-6), torch.float16: (1e-2, 1e-2),
             torch.bfloat16: (5e-2, 5e-2)}


def mismatch(name: str, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype}, eager {tuple(expected.shape)} {expected.dtype}"
    if not expected.is_floating_point():  # token ids, a sampler's draws: exactly eager's
        return None if torch.equal(got, expected) else f"{name}: {int((got != expected).sum())} entries differ"
    rtol, atol = TOLERANCE[expected.dtype]
    if torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True).all():
        return None
    return f"{name}: max abs diff {(got.float() - expected.float()).abs().max().item():.3g}"


def refusal(err: BaseException) -> bool:
    """Whether `err` (or what dynamo wrapped in it) is a compile-time refusal naming a layer."""
    while err is not None:
        if isinstance(err, (AscendCompileError, ValueError, NotImplementedError)) and "layer" in str(err):
            return True
        err = err.__cause__ or getattr(err, "inner_exception", None)
    return False


class Differential(RuleBasedStateMachine):
    """The compiled model and its eager twin, stepped together."""

    def __init__(self) -> None:
        super().__init__()
        self.monkeypatch = pytest.MonkeyPatch()
        self.setup: Setup | None = None
        self.refused = False
        self.steps = 0

    @initialize(setup=setups(), seed=st.integers(0, 2**16))
    def compile(self, setup: Setup, seed: int) -> None:
        self.setup = setup
        if setup.runtime == "npu":
            fake_torch_npu.install(self.monkeypatch)
        torch._dynamo.reset()
        self.model, self.twin, self.cfg = build_pair(setup)
        if setup.entry == "compile":
            self.fn = ascend_compile.compile(self.model, dict(setup.options), dispatch=setup.dispatch)
        else:
            self.fn = torch.compile(self.model, backend="ascend_graph", options=dict(setup.options),
                                    dynamic=True if setup.entry.endswith("(dynamic=True)") else None)
        self.batch = PagedBatch(self.cfg, seed=seed)
        self.rng = random.Random(seed)

    def teardown(self) -> None:
        self.monkeypatch.undo()
        torch._dynamo.reset()

    # -- steps -----------------------------------------------------------------------------------

    def lengths(self, n: int, at_least: int = 1) -> list[int]:
        top = self.setup.max_model_len
        return [self.rng.randint(min(at_least, top), top) for _ in range(n)]

    def fits(self, lens: list[int]) -> bool:
        return sum(max(1, -(-n // self.cfg.block_size)) for n in lens) <= self.cfg.num_blocks

    @precondition(lambda self: not self.refused)
    @rule(batch=st.integers(1, 20))
    def decode(self, batch: int) -> None:
        lens = self.lengths(batch)
        if self.fits(lens):
            self.step(lens, None)

    @precondition(lambda self: not self.refused)
    @rule(query_lens=st.lists(st.sampled_from((0, 1, 1, 2, 3, 5, 8)), min_size=1, max_size=8))
    def mixed(self, query_lens: list[int]) -> None:
        query_lens = [min(q, self.setup.max_model_len) for q in query_lens]
        lens = [max(q, n) for q, n in zip(query_lens, self.lengths(len(query_lens)))]
        # A step of no token at all is no step a runtime sends, and dynamo's trace and eager differ on it
        # (the model's `view(0, -1)` raises eagerly, its traced `view(T, H * D)` does not).
        if sum(query_lens) and self.fits(lens):
            self.step(lens, query_lens)

    @precondition(lambda self: not self.refused)
    @rule(chunk=st.integers(9, 40), decodes=st.integers(0, 4))
    def chunked_prefill(self, chunk: int, decodes: int) -> None:
        chunk = min(chunk, self.setup.max_model_len)
        lens = self.lengths(1, at_least=chunk) + self.lengths(decodes)
        if self.fits(lens):
            self.step(lens, [chunk] + [1] * decodes)

    # -- user actions between steps ----------------------------------------------------------------

    @precondition(lambda self: not self.refused)
    @rule(seed=st.integers(0, 2**16))
    def new_kv_cache(self, seed: int) -> None:
        """Every cache buffer assigned a new tensor (its old one freed), the same in both models."""
        generator = torch.Generator().manual_seed(seed)
        for module, twin in zip(self.model.modules(), self.twin.modules()):
            for name, buffer in list(module.named_buffers(recurse=False)):
                if "cache" in name:
                    fresh = torch.randn(buffer.shape, generator=generator).to(buffer.dtype)
                    setattr(module, name, fresh)
                    setattr(twin, name, fresh.clone())

    @precondition(lambda self: not self.refused)
    @rule(seed=st.integers(0, 2**16))
    def load_weights_in_place(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.twin.parameters()):
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.05)
                    q.copy_(p)

    # -- the comparison ----------------------------------------------------------------------------

    def buffers(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return dict(model.named_buffers())

    def step(self, lens: list[int], query_lens: list[int] | None) -> None:
        inputs = self.batch.step(lens, query_lens)
        before = {k: v.clone() for k, v in self.buffers(self.model).items()}
        ours = theirs = None
        seed = self.rng.randrange(2**31)  # both draw from the generators seeded alike
        with torch.no_grad():
            try:
                torch.manual_seed(seed)
                got = self.fn(**{k: v.clone() for k, v in inputs.items()})
            except Exception as err:  # noqa: BLE001 - compared with eager's below
                ours = err
            try:
                torch.manual_seed(seed)
                expected = self.twin(**inputs)
            except Exception as err:  # noqa: BLE001
                theirs = err
        where = f"step {lens} {query_lens}"
        if ours is not None:
            left = [name for name, t in self.buffers(self.model).items() if not torch.equal(t, before[name])]
            assert not left, f"{where} raised {ours!r} and left {left} half-written"
            if theirs is not None:  # refused by both: our caches as before; eager's made equal to ours
                for name, t in self.buffers(self.twin).items():
                    t.copy_(before[name])
                return
            if self.steps == 0 and self.setup.runtime == "npu" and refusal(ours):
                self.refused = True  # a feature the target lacks, refused at compile time naming the layer
                return
            raise AssertionError(f"{where} raised, eager did not: {ours!r}") from ours
        assert theirs is None, f"{where}: eager raised {theirs!r}, the compiled step did not"
        self.steps += 1
        got, expected = (got, expected) if isinstance(expected, tuple) else ((got,), (expected,))
        wrong = [mismatch(f"output {i}", g, e) for i, (g, e) in enumerate(zip(got, expected))]
        twin = self.buffers(self.twin)
        wrong += [mismatch(name, t, twin[name]) for name, t in self.buffers(self.model).items()]
        wrong = [w for w in wrong if w]
        assert not wrong, f"{where} differs from eager: {'; '.join(wrong)}"

    @invariant()
    def refusals_name_a_feature_npu_lacks(self) -> None:
        if self.refused:
            assert self.setup.runtime == "npu", "only runtime 'npu' refuses a drawn setup at compile time"


if PROFILE == "ci":
    Differential = seed(SEED)(Differential)


def test_compiled_steps_equal_eager_whatever_the_model_options_and_actions():
    run_state_machine_as_test(Differential, settings=settings.get_profile(PROFILE))


# -- what the tester found, as plain tests ----------------------------------------------------------


def run_steps(setup: Setup, steps) -> None:
    """`setup` compiled and stepped through `steps` ((context lengths, query lengths or None)), each step
    compared with eager by the state machine's own comparison."""
    machine = Differential()
    try:
        machine.compile(setup, seed=0)
        for lens, query_lens in steps:
            machine.step(lens, query_lens)
    finally:
        machine.teardown()


def plain_setup(**options) -> Setup:
    base = dict(capture_sizes=(1, 16), max_model_len=4, runtime="sim", kernel_policy="pa_max_batch", pa_max_batch=1)
    base.update(options)
    return Setup(model="dense", runtime=base["runtime"], entry="compile", dispatch="dynamo", dtype=torch.float32,
                 num_layers=1, num_kv_heads=4,
                 block_size=8, max_model_len=base["max_model_len"], layer_types=("sliding",), sliding_window=1,
                 soft_cap=None, sinks=False, sample=False, options=tuple(base.items()))


def test_dummy_sequences_fit_the_block_table_when_max_model_len_is_below_the_padding_chunk():
    """A bucket's padding packed into a dummy sequence longer than one block-table row holds (max_model_len
    4, blocks of 8: a row of one block) failed the capture (`actual_seq_lengths_kv: expected lengths of at
    most 8 ... got 16`); dummies are now at most a row's capacity (`padding.dummy_limit`)."""
    run_steps(plain_setup(), [([4, 4, 1, 3, 4], None), ([4, 3], [2, 3]), ([2], None)])


def test_capture_all_on_a_static_first_trace_serves_a_later_one_sequence_mixed_step():
    """The tester's first find on 56cf2ee (issue 36, item 1's family): `torch.compile` (a static first trace)
    with `capture_all`, a chunked-prefill first step, then one sequence of 5 query tokens: the step was sent
    to a graph never captured (`'NoneType' object has no attribute 'replay'`)."""
    options = dict(capture_sizes=(1, 2, 6), max_model_len=331, runtime="npu", kernel_policy="fia", capture_all=True,
                   share_workspace=False, frozen_parameters=False, verify=False, clone_outputs=True)
    setup = Setup(model="mla", runtime="npu", entry="torch.compile", dispatch="dynamo", dtype=torch.bfloat16,
                  num_layers=2, num_kv_heads=2, block_size=128, max_model_len=331, layer_types=(), sliding_window=None,
                  soft_cap=None, sinks=False, sample=False, options=tuple(options.items()))
    run_steps(setup, [([300, 20, 31, 7, 200], [30, 1, 1, 1, 1]), ([90], [5]), ([40, 41], None)])
