"""Failed steps (issue 36): what `capture_all` captures for a graph whose steps are not padded, and
a compiled step that raises after some layers wrote their KV rows leaving every cache and written
input as before the step."""
from __future__ import annotations

import sys

import torch
import pytest

from examples.llama import LlamaConfig, LlamaDecoder, PagedBatch, build
from tests.helpers import TOLERANCE
from tests.test_backend import MAX_LEN, compiled_model

TOL = dict(atol=2e-5, rtol=1e-4)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within float32's tolerance, or a half-precision dtype's (runtime "npu" takes no float32)."""
    tol = TOL if want.dtype == torch.float32 else dict(atol=TOLERANCE[want.dtype], rtol=TOLERANCE[want.dtype])
    torch.testing.assert_close(got, want, **tol)


def caches(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if name.endswith("_cache")]


def assert_caches_close(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for got, want in zip(caches(model), caches(reference), strict=True):
        assert_close(got, want)


#: A plain `torch.compile` (automatic dynamic): the first step's graph is static, the next ones are
#: dynamic with one sequence kept static (a one-sequence mixed step), then fully dynamic.
STEPS = [([20], [5]), ([33], None), ([50, 60, 70], [3, 2, 1]), ([20], [5]), ([12], None), ([40, 41], [4, 3])]


@pytest.mark.parametrize("policy", ["auto", "pa_max_batch"])
@pytest.mark.parametrize("first", [[([30, 40, 50], None)], []], ids=["decode-first", "mixed-first"])
def test_capture_all_serves_a_one_sequence_mixed_step_and_later_steps(policy, first):
    """With `capture_all`, a graph whose sizes are not padded to the buckets (dynamo's static first
    graph, or one with a static sequence count) captures the step's own graph only: every bucket's
    decode graph captured at a mixed step's sizes put 5 query tokens of one sequence into PA. A
    first step that is mixed gets its mixed graph captured too (capture_all captures decode graphs)."""
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8), capture_all=True,
                                   kernel_policy=policy)
    batch = PagedBatch(cfg, seed=1)
    with torch.no_grad():
        for lens, query_lens in first + STEPS:
            inputs = batch.step(lens, query_lens)
            assert_close(fn(**inputs), reference(**inputs))
            assert_caches_close(model, reference)
    stats = [a.stats for a in artifacts]
    assert sum(s["eager_fallbacks"] for s in stats) == 0 and sum(s["replays"] for s in stats) == len(first + STEPS)
    for art in artifacts:
        captured = {g.name for g in art.graphs.values() if g.graph is not None}
        if art.signature.can_pad and not isinstance(art.signature.tokens, int):  # padded: every decode bucket
            assert {"b1.decode", "b2.decode", "b4.decode", "b8.decode"} <= captured, captured
        else:  # each size its own capture: only the graphs of the steps it served
            assert len(captured) == art.stats["captures"] <= art.stats["steps"], captured


#: The length of a sequence in the steps a test makes fail.
MARK = 77


class InjectedFault(RuntimeError):
    """The failure a test puts into a graph's kernel."""


@pytest.fixture
def fault_in_layer(monkeypatch):
    """`arm(artifacts, cache, mark)`: from then on, the reference PA and FIA kernels raise when a
    graph of one of `artifacts` runs them (they are given its workspace slots, which eager calls never
    are) over `cache`, a later layer's KV cache, in a call with a sequence of `mark` tokens (None: any
    call, a capture's run too): the step has written the earlier layers' rows by then. `disarm()`
    ends it. The simulator's kernels and the fake torch_npu's compute with these kernels."""
    from ascend_compile.ops import reference

    armed: dict = {}

    def faulty(kernel):
        def run(*args, **kwargs):
            if armed and args[1].data_ptr() == armed["cache"]:
                slots = {w.data_ptr() for a in armed["artifacts"] for w in a.workspaces.values()}
                if any(isinstance(a, torch.Tensor) and a.data_ptr() in slots for a in args) and (
                        armed["mark"] is None or any(isinstance(a, list) and armed["mark"] in a for a in args)):
                    raise InjectedFault(f"{kernel.__name__} failed on the later layer")
            return kernel(*args, **kwargs)
        return run

    for name in ("paged_attention", "fused_infer_attention"):
        monkeypatch.setattr(reference, name, faulty(getattr(reference, name)))

    def arm(artifacts, cache, mark=MARK):
        armed.update(artifacts=artifacts, cache=cache.data_ptr(), mark=mark)

    arm.disarm = armed.clear
    return arm


class Counted(torch.nn.Module):
    """The example model, counting its steps in a buffer it writes in place by a plain op."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.model = build(cfg)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, **inputs):
        self.calls.add_(1)
        return self.model(**inputs)


class WritesLogits(torch.nn.Module):
    """The example model, also writing its logits into a buffer the caller passes (vLLM-style)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.model = build(cfg)

    def forward(self, out, **inputs):
        logits = self.model(**inputs)
        out.copy_(logits)
        return logits


def _config(runtime: str, monkeypatch) -> LlamaConfig:
    if runtime == "npu":
        from tests import fake_torch_npu

        fake_torch_npu.install(monkeypatch)
        return LlamaConfig(num_layers=3, num_blocks=128, block_size=128, dtype=torch.bfloat16)  # half precision
    return LlamaConfig(num_layers=3, num_blocks=1024)


def _written(model: torch.nn.Module, inputs: dict | None = None) -> list[torch.Tensor]:
    """What a step of `model` writes: its caches, a Counted model's count, the caller's buffer."""
    return [*caches(model), *([model.calls] if isinstance(model, Counted) else []),
            *([inputs["out"]] if inputs and "out" in inputs else [])]


def _assert_as_before(model: torch.nn.Module, before: list[torch.Tensor], inputs: dict | None = None,
                      own_slots: torch.Tensor | None = None) -> None:
    """Every cache, the step count and the caller's buffer bitwise as `before`; with `own_slots` (the
    default, caches' rows not saved) each cache's rows outside those slots only."""
    for got, want in zip(_written(model, inputs), before, strict=True):
        if own_slots is not None and got.dim() >= 3 and got.shape[1] == want.shape[1]:
            keep = torch.ones(got.shape[0] * got.shape[1], dtype=torch.bool)
            keep[own_slots[own_slots >= 0].long()] = False
            got, want = got.flatten(0, 1)[keep], want.flatten(0, 1)[keep]
        assert torch.equal(got, want), "the failed step left a cache (another row), the step count or the caller's buffer written"


def assert_names_its_rows(err: BaseException, inputs: dict, seqs: int) -> None:
    """The failed step's note: the sequences and the slot range its tokens own, no other row."""
    slots = sorted(v for v in inputs["slot_mapping"].tolist() if v >= 0)
    note = " ".join(getattr(err, "__notes__", []))
    assert f"slots {slots[0]}..{slots[-1]} ({len(set(slots))} slots), for its {seqs} sequences" in note, note
    assert "no other row; run the same step again" in note, note


def _layer(model: torch.nn.Module, i: int) -> torch.nn.Module:
    return (model if isinstance(model, LlamaDecoder) else model.model).layers[i]


@pytest.mark.parametrize("save", [False, True], ids=["default", "save_cache_rows"])
@pytest.mark.parametrize("runtime, verify, make", [("sim", False, build), ("sim", True, WritesLogits),
                                                   ("eager", None, build), ("npu", None, build),
                                                   ("sim", False, Counted)],
                         ids=["sim", "sim-verify", "eager", "npu", "sim-counted"])
def test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before(runtime, verify, make, save, fault_in_layer,
                                                                      monkeypatch):
    """A graph's kernel raising on layer 1 of 3, after layers 0 and 1 wrote their KV rows: in a
    replay, in a first replay checked against eager (`verify`, the default on npu: eager's writes are
    undone too, a caller's buffer it wrote directly included), in a graph run op by op (runtime
    "eager"), and in a model that also counts its steps in a buffer (saved whole; its graphs are not
    padded). Under `save_cache_rows` every cache (the count, the buffer) is bitwise as before the step;
    by default (nothing of the caches saved) every row but the step's own slots is, the count and the
    buffer too, and the error names those slots and the step's sequences. Either way the graph is
    captured again and the same step then equals eager, and so do the steps after it."""
    cfg = _config(runtime, monkeypatch)
    model, reference = make(cfg), make(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4,
                                   runtime=runtime, verify=verify, save_cache_rows=save)
    batch = PagedBatch(cfg, seed=2)

    def step(lens):
        inputs = batch.step(lens)
        return {**inputs, "out": torch.zeros(len(lens), cfg.vocab_size)} if make is WritesLogits else inputs

    with torch.no_grad():
        for lens in ([30, 40], [31, 41, 51, 61]):  # dynamo's static graph (batch 2), then the dynamic one (b4)
            inputs = step(lens)
            assert_close(fn(**inputs), reference(**inputs))
        art = artifacts[-1]
        captures = art.stats["captures"]
        # a replay of b4.decode (PA), then the first replay of b8.decode (FIA), each failing on layer 1
        for lens in ([32, 42, MARK], [60, 70, 80, MARK, 100, 110]):
            inputs = step(lens)
            before = [t.clone() for t in _written(model, inputs)]
            fault_in_layer(artifacts, _layer(model, 1).attn.key_cache)
            with pytest.raises(InjectedFault) as raised:
                fn(**inputs)
            fault_in_layer.disarm()
            _assert_as_before(model, before, inputs, None if save else inputs["slot_mapping"])
            if not save:
                assert_names_its_rows(raised.value, inputs, len(lens))
            expected = {**inputs, "out": inputs["out"].clone()} if "out" in inputs else inputs
            assert_close(fn(**inputs), reference(**expected))  # the same step, again
            for got, want in zip(_written(model, inputs), _written(reference, expected), strict=True):
                assert_close(got, want)
        for lens in ([33, 43, 53], [61, 71, 81, 91, 101]):  # later steps
            inputs = step(lens)
            expected = {**inputs, "out": inputs["out"].clone()} if "out" in inputs else inputs
            assert_close(fn(**inputs), reference(**expected))
        for got, want in zip(_written(model, inputs), _written(reference, expected), strict=True):
            assert_close(got, want)
    assert art.stats["failed_steps"] == 2 and art.stats["eager_fallbacks"] == 0
    if runtime != "eager":  # the failed graphs were dropped, captured again, and served the steps again
        assert art.stats["replays"] == 5 and art.stats["captures"] > captures + 2
    # nothing of the caches saved by default: no work outside the graph (the count is saved whole)
    assert (art.stats["launches_outside_graph"] == 0) == (not save and make is not Counted)


class CacheTouched(Counted):
    """The counted example model whose step also writes its first layer's key cache by a plain op (a row
    kept at the step count, outside every slot the cache write has)."""

    def forward(self, **inputs):
        self.calls.add_(1)
        cache = self.model.layers[0].attn.key_cache
        cache[-1, -1].fill_(0).add_(self.calls)  # the last row of the last block: no step's slot
        return self.model(**inputs)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, InjectedFault], ids=["KeyboardInterrupt", "RuntimeError"])
def test_a_step_interrupted_mid_graph_with_a_cache_a_plain_op_writes_too(fault_in_layer, monkeypatch, interrupt):
    """A BaseException (Ctrl-C) raised by a later layer's kernel mid-step stays what it is, with the
    note naming the step's slots; a cache written both by its cache write (at the step's slots) and
    by a plain op (elsewhere) is put back where the plain op wrote it (the plain op has no slot
    contract: that cache is saved whole), the count too; the same step again and every later step
    equal eager."""
    cfg = LlamaConfig(num_layers=3, num_blocks=64)
    model, reference = CacheTouched(cfg), CacheTouched(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        for lens in ([30, 40], [31, 41, 51, 61], [32, 42, 52, 62]):
            inputs = batch.step(lens)
            assert_close(fn(**inputs), reference(**inputs))
        inputs = batch.step([33, 43, MARK])
        before = [t.clone() for t in _written(model, inputs)]
        fault_in_layer(artifacts, model.model.layers[1].attn.key_cache)
        if interrupt is KeyboardInterrupt:  # the fixture's fault, as a KeyboardInterrupt
            monkeypatch.setattr(sys.modules[__name__], "InjectedFault", KeyboardInterrupt)
        with pytest.raises(interrupt) as raised:
            fn(**inputs)
        fault_in_layer.disarm()
        assert type(raised.value) is interrupt
        _assert_as_before(model, before, inputs, inputs["slot_mapping"])
        assert_names_its_rows(raised.value, inputs, 3)
        assert_close(fn(**inputs), reference(**inputs))  # the same step, again
        for lens in ([34, 44, MARK + 1], [35, 45, 55, 65]):
            inputs = batch.step(lens)
            assert_close(fn(**inputs), reference(**inputs))
        for got, want in zip(_written(model), _written(reference), strict=True):
            assert_close(got, want)
    assert sum(a.stats["failed_steps"] for a in artifacts) == 1


@pytest.mark.parametrize("runtime", ["sim", "npu"])
def test_a_capture_failing_on_a_later_layer_leaves_the_inputs_it_wrote_as_before(runtime, fault_in_layer,
                                                                                monkeypatch):
    """A capture runs the graph (the simulator's capture run, npu's warm-up): one raising on layer 1
    has incremented the step count, which a successful capture puts back; a failed one must too."""
    cfg = _config(runtime, monkeypatch)
    model, reference = Counted(cfg), Counted(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4,), runtime=runtime)
    inputs = PagedBatch(cfg, seed=2).step([30, 40, 50])
    before = [t.clone() for t in _written(model)]
    fault_in_layer(artifacts, _layer(model, 1).attn.key_cache, mark=None)
    with torch.no_grad():
        with pytest.raises(Exception, match="failed on the later layer"):
            fn(**inputs)
        _assert_as_before(model, before)
        assert artifacts[-1].stats["captures"] == 0
        fault_in_layer.disarm()
        assert_close(fn(**inputs), reference(**inputs))
    assert_caches_close(model, reference)
    assert torch.equal(model.calls, reference.calls) and artifacts[-1].stats["replays"] == 1


@pytest.mark.parametrize("save", [False, True], ids=["default", "save_cache_rows"])
def test_a_slot_past_the_cache_is_refused_by_the_cache_write_naming_it(save):
    """The cache write refuses a slot past the cache by name, and nothing of the step stays written.
    Under `save_cache_rows` the undo log reads the step's slots before the graph runs: a slot past the
    cache is clamped there (a gather would fail first, with no name)."""
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4,), save_cache_rows=save)
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad():
        for lens in ([30, 40], [31, 41, 51]):
            inputs = batch.step(lens)
            assert_close(fn(**inputs), reference(**inputs))
        inputs = batch.step([32, 42, 52])
        inputs["slot_mapping"][-1] = cfg.num_blocks * cfg.block_size + 5
        before = [c.clone() for c in caches(model)]
        with pytest.raises(ValueError, match=r"slot_mapping: expected slots below 16384"):
            fn(**inputs)
    assert all(torch.equal(got, want) for got, want in zip(caches(model), before, strict=True))
    assert artifacts[-1].stats["failed_steps"] == 1
