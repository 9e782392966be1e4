"""The vLLM integration against the stand-in (`tests/vllm_standin.py`, checked against the pinned vLLM
source by `tests/test_vllm_fixture.py`): vLLM's real attention ops, metadata and caches only in the
forward context, compiled through `ascend_compile.integrations.vllm.backend`."""
from __future__ import annotations

import collections
import json
import logging
import random
import re

import pytest
import torch

from ascend_compile import cli
from ascend_compile.config import CompileConfig
from ascend_compile.integrations import vllm as integration
from ascend_compile.integrations.vllm.memory import graph_memory
from ascend_compile.ops.npu import band_probe as npu_band_probe
from tests import fake_torch_npu
from tests import vllm_standin as v

BUCKETS = (4, 8)
MAX_LEN = 512


class Pair:
    """The stand-in model compiled and an identical eager one, each with its own caches and config."""

    def __init__(self, backend: str, block_size: int, runtime: str, artifacts: list,
                 attention_options: dict[int, dict] | None = None, rotary: bool = False, **options) -> None:
        self.block_size, self.num_blocks = block_size, 96
        #: runtime "npu" takes half precision (torch_npu's PA and FIA refuse float32) and FIA a head dim
        #: that is a multiple of 16
        self.dtype = torch.bfloat16 if runtime == "npu" else torch.float32
        head_size = 16 if runtime == "npu" else 8
        self.configs = v.VllmConfig(), v.VllmConfig()
        model_cls = v.RotaryModel if rotary else v.StandInModel
        self.models = [model_cls(c, backend=backend, seed=3, attention_options=attention_options,
                                 head_size=head_size).to(self.dtype) for c in self.configs]
        for model in self.models:
            v.bind_kv_cache(model, self.num_blocks, block_size, dtype=self.dtype)
        config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=BUCKETS, pa_max_batch=4, runtime=runtime, **options)
        torch._dynamo.reset()
        compile_fn = integration.backend(config, on_compiled=artifacts.append, get_forward_context=v.get_forward_context)
        self.compiled = torch.compile(self.models[0], backend=compile_fn, dynamic=True)

    def step(self, rng: random.Random, batch: int, mixed: bool, shortest: int = 4) -> v.Step:
        width = MAX_LEN // self.block_size
        seq_lens = [rng.randint(shortest, MAX_LEN - 4) for _ in range(batch)]
        query_lens = [rng.randint(1, 3) if mixed else 1 for _ in range(batch)]
        blocks = torch.randperm(self.num_blocks)[: batch * width] if batch * width <= self.num_blocks else \
            torch.randint(0, self.num_blocks, (batch * width,))
        return v.Step(seq_lens, query_lens, blocks.view(batch, width).to(torch.int32), self.block_size)

    def run(self, step: v.Step, spare_reqs: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 64, (step.num_tokens,), generator=torch.Generator().manual_seed(step.num_tokens))
        positions = torch.tensor(step.positions())
        outs = []
        for model, config, fn in zip(self.models, self.configs, (self.compiled, self.models[1])):
            attn_metadata, slot_mapping = v.build_metadata(model, step, spare_reqs=spare_reqs)
            with torch.no_grad(), v.set_forward_context(attn_metadata, config, slot_mapping=slot_mapping):
                outs.append(fn(ids, positions))
        return outs[0], outs[1]

    def assert_caches_close(self) -> None:
        """The compiled model's caches hold what the eager one's do (up to the rounding of the padded
        batch's matmuls)."""
        a, b = (m.attention_layers() for m in self.models)
        for x, y in zip(a.values(), b.values()):
            for got, expected in zip(_pair(x.kv_cache), _pair(y.kv_cache)):
                torch.testing.assert_close(got, expected, **CACHE_TOL[self.dtype])


#: Compiled vs eager, per dtype: float32 up to the padded matmuls' rounding, bfloat16 its own.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
CACHE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _pair(kv_cache):
    return kv_cache if isinstance(kv_cache, tuple) else kv_cache.unbind(1)


# batches inside, between and above the buckets; decode and mixed
STEPS = [(3, False), (4, False), (2, True), (6, False), (5, True), (8, False), (1, False), (11, False), (3, True)]


@pytest.mark.parametrize("backend, runtime", [("FLASH_ATTN", "sim"), ("ASCEND", "sim"), ("ASCEND", "npu")])
def test_vllm_model_equals_eager_with_metadata_only_in_the_forward_context(backend, runtime, monkeypatch):
    if runtime == "npu":
        fake_torch_npu.install(monkeypatch)
    artifacts = []
    pair = Pair(backend, 128 if runtime == "npu" else 16, runtime, artifacts)
    rng = random.Random(f"{backend}{runtime}")
    for batch, mixed in STEPS:
        got, expected = pair.run(pair.step(rng, batch, mixed))
        torch.testing.assert_close(got, expected, **TOL[pair.dtype])
        pair.assert_caches_close()
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    # every step replayed a graph, but those above the largest bucket (11 tokens, big mixed steps): piecewise
    assert stats["steps"] == len(STEPS) == stats["replays"] + stats["piecewise_steps"] + stats["eager_fallbacks"]
    assert 1 <= stats["piecewise_steps"] <= 3 and stats["eager_fallbacks"] == 0 and stats["captures"] >= 3


def test_flash_attn_cache_halves_are_refused_at_compile_on_npu(monkeypatch):
    # FLASH_ATTN's [num_blocks, 2, ...] cache unbound into its halves: neither is contiguous, which
    # torch_npu's kernels do not take ("输入参数不支持非连续"); a copy would copy the whole cache per call.
    fake = fake_torch_npu.install(monkeypatch)
    pair = Pair("FLASH_ATTN", 128, "npu", [])
    with pytest.raises(Exception, match="key_cache: torch_npu.npu_scatter_pa_kv_cache takes contiguous tensors"):
        pair.run(pair.step(random.Random(0), 3, False))
    assert not fake.executed and not fake.writes


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
def test_query_start_loc_longer_than_the_step_is_cut_to_its_sequences(backend):
    """A runner's `query_start_loc` and block table may be views of its persistent buffers, longer than
    `num_reqs + 1` (the tail repeating the last offset) and `num_reqs` rows: the step reads the first
    `num_reqs + 1` entries and `num_reqs` rows."""
    artifacts = []
    pair = Pair(backend, 16, "sim", artifacts)
    rng = random.Random(7)
    for batch, mixed in [(3, False), (2, True), (3, False), (4, True)]:
        got, expected = pair.run(pair.step(rng, batch, mixed), spare_reqs=5)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert sum(a.stats["replays"] for a in artifacts) == 4


def test_vllm_ascends_int32_slot_mapping_reaches_the_cache_write_unconverted():
    """`ascend.reshape_and_cache` takes int32 slots (torch_npu's `npu_scatter_pa_kv_cache` does): each
    step's provided input is a view of the metadata's slots (no int64 copy per step), and the graph's
    cache writes take that input itself."""
    artifacts = []
    pair = Pair("ASCEND", 16, "sim", artifacts)
    rng = random.Random(4)
    provider = None
    for batch, mixed in [(3, False), (2, True), (3, False)]:
        step = pair.step(rng, batch, mixed)
        got, expected = pair.run(step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        provider = artifacts[0].rewritten.prologue.provider
        metadata, _ = v.build_metadata(pair.models[0], step)
        with v.set_forward_context(metadata, pair.configs[0]):
            provided = dict(zip((i.name for i in provider.inputs), provider.read(())))
        slots = provided["vllm_slot_mapping_0"]
        assert slots.dtype == torch.int32 and slots.data_ptr() == metadata[LAYER_1].slot_mapping.data_ptr()
    assert artifacts[0].stats["replays"] == 3
    for variant in artifacts[0].rewritten.variants.values():
        writes = [n for n in variant.gm.graph.nodes if n.target is torch.ops.ascend.reshape_and_cache.default]
        assert len(writes) == 2 and all(n.args[4].op == "placeholder" for n in writes)
        assert {n.args[4].meta["example_value"].dtype for n in writes} == {torch.int32}


# ---------------------------------------------------------------- vLLM-Ascend's host copies of the lengths

_DEVICE_READS: list[str] = []
#: What reads a tensor's data on the host (a device-to-host sync for a device tensor).
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
               torch.Tensor.__index__, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__iter__}


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one in device memory: every host read of its data (or of a view's
    or an op's result of it) is recorded in `_DEVICE_READS`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            _DEVICE_READS.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs)


def _on_device(metadata: dict, fields: tuple[str, ...]) -> dict:
    """The per-layer metadata with `fields` as `DeviceTensor`s (one object shared by every layer, as built)."""
    meta = next(iter(metadata.values()))
    for field in fields:
        setattr(meta, field, getattr(meta, field).as_subclass(DeviceTensor))
    return {name: meta for name in metadata}


def _device_reads_per_step(pair: Pair, fields: tuple[str, ...], corrupt=None) -> list[int]:
    """Run steps on vLLM-Ascend metadata whose `fields` are device tensors (the compiled model's; the
    eager one gets the step's metadata as built), equal to eager; the device reads of each step after the first."""
    rng = random.Random(11)
    reads = []
    for batch, mixed in [(3, False), (2, True), (3, False), (2, True), (4, False)]:  # each fits a bucket
        step = pair.step(rng, batch, mixed)
        ids, positions = torch.randint(0, 64, (step.num_tokens,)), torch.tensor(step.positions())
        outs = []
        for model, config, fn in zip(pair.models, pair.configs, (pair.compiled, pair.models[1])):
            metadata, _ = v.build_metadata(model, step)
            if fn is pair.compiled:
                metadata = _on_device(metadata, fields)
                if corrupt is not None:
                    corrupt(next(iter(metadata.values())))
            del _DEVICE_READS[:]
            with torch.no_grad(), v.set_forward_context(metadata, config):
                outs.append(fn(ids, positions))
            if fn is pair.compiled:
                reads.append(len(_DEVICE_READS))
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)
    return reads[1:]


@pytest.mark.parametrize("fields", [("query_start_loc", "block_tables", "slot_mapping"),
                                    ("query_start_loc", "block_tables", "slot_mapping", "seq_lens")],
                         ids=["host seq_lens", "device seq_lens"])
def test_vllm_ascend_steps_read_no_length_from_the_device(fields):
    """vLLM-Ascend's metadata keeps host copies of its lengths (`seq_lens_list`, `actual_seq_lengths_q`):
    the runner takes them, so a step reads nothing from the device (its `query_start_loc` is a device
    tensor; `seq_lens` is a host one unless vLLM-Ascend built it from the device's, as for cross-attention)."""
    artifacts = []
    pair = Pair("ASCEND", 16, "sim", artifacts)
    assert _device_reads_per_step(pair, fields) == [0, 0, 0, 0]
    stats = artifacts[0].stats
    assert stats["host_conversions"] == 0 and stats["host_copies"] == 2 * stats["steps"] == 10
    assert stats["replays"] == 5
    sources = {i["name"]: i["source"] for i in artifacts[0].describe()["provided_inputs"]}
    assert sources["vllm_query_start_loc_0"].endswith("(on the host: [0] + .actual_seq_lengths_q)")


def _stale(meta):
    meta.actual_seq_lengths_q = [end - 1 for end in meta.actual_seq_lengths_q]


def _one_end_too_many(meta):
    meta.actual_seq_lengths_q = [*meta.actual_seq_lengths_q, meta.actual_seq_lengths_q[-1]]


def _one_length_too_many(meta):
    meta.seq_lens_list = [*meta.seq_lens_list, 1]


@pytest.mark.parametrize("corrupt, why", [
    (_stale, r"actual_seq_lengths_q ends at \d+, before the step's num_actual_tokens=\d+ \(stale\)"),
    # the warning is the first step's, of 3 sequences
    (_one_end_too_many, r"seq_lens_list \(3 entries\) and actual_seq_lengths_q \(4\) do not have one entry per "
                        r"sequence of seq_lens \(3\)"),
    (_one_length_too_many, r"seq_lens_list \(4 entries\) and actual_seq_lengths_q \(3\) do not have one entry per "
                           r"sequence of seq_lens \(3\)"),
], ids=["stale", "one end too many", "one length too many"])
def test_stale_vllm_ascend_host_lengths_are_not_used(caplog, corrupt, why):
    """Host copies failing a check (ends short of the step's tokens: a previous step's list; a list
    with an entry more than the step has sequences) are not taken: the step reads the device
    tensors, with one warning saying why, and stays equal to eager."""
    artifacts = []
    pair = Pair("ASCEND", 16, "sim", artifacts)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert _device_reads_per_step(pair, ("query_start_loc",), corrupt=corrupt) == [1, 1, 1, 1]
    warnings = [r.getMessage() for r in caplog.records if "reading seq_lens and query_start_loc" in r.getMessage()]
    assert len(warnings) == 1 and re.search(why, warnings[0]), warnings
    assert artifacts[0].stats["host_copies"] == 0


def test_a_host_copy_of_another_length_than_its_tensor_fails_the_step_naming_the_input(monkeypatch):
    """The runner takes a provider's host copies on its word (`Provider.host`), but not one whose
    length is not its tensor's (a provider's bug): the step fails naming the input and both lengths,
    before a kernel blames another argument."""
    monkeypatch.setattr(integration.metadata.HostLengths, "problem", staticmethod(lambda *args: None))  # checks nothing
    pair = Pair("ASCEND", 16, "sim", [])
    step = pair.step(random.Random(5), 3, False)
    metadata, _ = v.build_metadata(pair.models[0], step)
    _one_end_too_many(next(iter(metadata.values())))
    ids, positions = torch.randint(0, 64, (step.num_tokens,)), torch.tensor(step.positions())
    with pytest.raises(ValueError, match=r"^vllm_query_start_loc_0: its host copy has 5 entries and the tensor 4: "
                                         r"a provider's host copy stands for the tensor's values"):
        with torch.no_grad(), v.set_forward_context(metadata, pair.configs[0]):
            pair.compiled(ids, positions)


def test_update_table_names_the_forward_context_fields(tmp_path, capsys):
    artifacts = []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts, dump_dir=str(tmp_path))
    pair.run(pair.step(random.Random(0), 3, False))
    plan = artifacts[-1].describe()
    layer = "model.layers.0.self_attn.attn"
    provided = {p["name"]: p["source"] for p in plan["provided_inputs"]}
    assert provided["vllm_seq_lens_0"] == f"forward_context.attn_metadata[{layer!r}].seq_lens"
    assert provided["vllm_slot_mapping_0"] == f"forward_context.slot_mapping[{layer!r}]"
    assert provided[f"vllm_key_cache_{layer.replace('.', '_')}"] == f"forward_context.no_compile_layers[{layer!r}].kv_cache (key)"
    (entry, _) = plan["graphs"]["b4.decode"]["update_table"]
    assert entry["refresh"] == {"context_lens": {"input": "vllm_seq_lens_0", "conversion": "list"}}
    roles = {i["name"]: i["role"] for i in plan["inputs"]}
    assert roles["vllm_seq_lens_0"] == "seq_lens" and roles["vllm_block_table_0"] == "block_table"
    assert roles[f"vllm_key_cache_{layer.replace('.', '_')}"] == "kv_cache"
    assert cli.main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "inputs the runtime provides each step" in text and "forward_context.attn_metadata" in text
    assert json.loads(json.dumps(plan, default=str))["provided_inputs"]


def test_profiling_run_without_metadata_runs_as_traced_then_compiles():
    artifacts = []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts)
    ids, positions = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    with torch.no_grad(), v.set_forward_context(None, pair.configs[0]):
        assert torch.count_nonzero(pair.compiled(ids, positions)) > 0  # vLLM's ops zero-fill attention only
    assert artifacts == []
    got, expected = pair.run(pair.step(random.Random(1), 3, False))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert len(artifacts) == 1


def test_binder_leaves_other_graphs_and_refuses_unknown_cache_layouts():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    binder = integration.ForwardContextBinder(v.get_forward_context)
    assert binder(gm) is None  # no vLLM attention: nothing to bind
    with pytest.raises(ValueError, match="a \\(key, value\\) pair or a \\[num_blocks, 2, block_size"):
        integration.context.split_cache(torch.zeros(3, 4), "forward_context.no_compile_layers['l'].kv_cache")


@pytest.mark.parametrize("release", ["0.30.1", "0.24.0", "0.330.0", "0.2.3", "1.0.0"])
def test_an_unsupported_vllm_release_is_refused_naming_the_supported_ones(monkeypatch, release):
    monkeypatch.setattr(integration.releases, "installed_version", lambda: release)
    with pytest.raises(RuntimeError, match=rf"vllm {release}: ascend_compile.integrations.vllm supports vLLM "
                                           rf"0\.23\.x, 0\.33\.x \("):
        integration.backend(max_model_len=64)


@pytest.mark.parametrize("release", ["0.23.0", "0.23.1", "0.33.0", "0.33.2"])
def test_the_supported_vllm_releases_are_accepted(monkeypatch, release):
    monkeypatch.setattr(integration.releases, "installed_version", lambda: release)
    assert callable(integration.backend(max_model_len=64))


def test_qualified_name_backend_takes_its_options_from_the_environment(monkeypatch):
    monkeypatch.setattr(integration.releases, "installed_version", lambda: "0.23.0")
    monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps({"max_model_len": 64, "no_such_option": 1}))
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match="unknown option\\(s\\) \\['no_such_option'\\]"):
        integration.vllm_backend(gm, [])
    monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps({"max_model_len": 64}))
    assert integration.vllm_backend(gm, []) == gm.forward  # no attention: runs as traced


@pytest.mark.skipif(not v.HAS_OPAQUE_TYPE, reason="torch without opaque types: vLLM uses str layer names")
def test_opaque_layer_names_hoisted_to_graph_inputs():
    v.register("LayerName")
    try:
        artifacts = []
        pair = Pair("FLASH_ATTN", 16, "sim", artifacts)
        rng = random.Random(2)
        for batch, mixed in STEPS[:4]:
            got, expected = pair.run(pair.step(rng, batch, mixed))
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        assert len(artifacts) == 1 and artifacts[0].stats["replays"] == 4
    finally:
        torch._dynamo.reset()
        v.register("str")


# ---------------------------------------------------------------- attention features: served, or refused


LAYER_1 = "model.layers.1.self_attn.attn"
WINDOW = 24
#: Features `ascend.attention` computes: (the stand-in `Attention`'s arguments, the features the plan records).
SERVED = {
    "sliding window": ({"per_layer_sliding_window": WINDOW}, {"window": WINDOW, "soft_cap": None, "sinks": False}),
    "soft-cap": ({"logits_soft_cap": 0.5}, {"window": None, "soft_cap": 0.5, "sinks": False}),
    "sinks": ({"sinks": torch.tensor([3.0, 6.0, 4.0, 5.0])}, {"window": None, "soft_cap": None, "sinks": True}),
}


def _without_features(impl) -> dict:
    """Switch an impl's features off (window, soft-cap, sinks); returns what to put back."""
    kept = {name: getattr(impl, name) for name in ("sliding_window", "logits_soft_cap", "sinks") if hasattr(impl, name)}
    impl.sliding_window = (-1, -1) if isinstance(impl.sliding_window, tuple) else None
    if hasattr(impl, "logits_soft_cap"):
        impl.logits_soft_cap = 0
    impl.sinks = None
    return kept


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
@pytest.mark.parametrize("feature", list(SERVED))
def test_layer_features_are_passed_to_the_attention_op_and_served_equal_to_eager(feature, backend):
    """A layer's sliding window, soft-cap or sinks reach `ascend.attention`: steps with sequences
    longer than the window, decode and mixed, equal eager (whose kernel applies the feature), and the
    feature matters: the eager model without it gives other outputs for the same step."""
    if feature == "soft-cap" and backend == "ASCEND":
        pytest.skip("vLLM-Ascend's AscendAttentionBackendImpl keeps no logits_soft_cap (its kernels apply none)")
    options, described = SERVED[feature]
    artifacts = []
    pair = Pair(backend, 16, "sim", artifacts, attention_options={1: options})
    rng = random.Random(f"{feature}{backend}")
    for batch, mixed in [(3, False), (2, True), (4, False), (3, True)]:
        step = pair.step(rng, batch, mixed, shortest=WINDOW + 4)  # every sequence longer than the window
        got, expected = pair.run(step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        pair.assert_caches_close()
    assert sum(a.stats["replays"] for a in artifacts) == 4
    impl = pair.models[1].attention_layers()[LAYER_1].impl
    kept = _without_features(impl)
    _, plain = pair.run(step)  # the last step again (its cache writes are the same)
    vars(impl).update(kept)
    assert (plain - expected).abs().max() > 1e-3
    for graph in artifacts[0].describe()["graphs"].values():  # layer 0 plain, layer 1 with its feature
        assert [kernel.get("features") for kernel in graph["kernels"]] == [None, described]


@pytest.mark.parametrize("band_at_single_query", [False, True], ids=["docs-band-ignored-at-s1", "band-applied-at-s1"])
@pytest.mark.parametrize("feature", ["sliding window", "sinks"])
def test_vllm_ascend_layer_features_are_served_on_npu_as_vllm_ascend_serves_them(feature, band_at_single_query,
                                                                                   monkeypatch):
    """On runtime "npu" (the fake torch_npu), a vLLM-Ascend layer's window is FIA's band mode and its sinks
    (bfloat16, as gpt-oss's are) FIA v2's `learnable_sink` (`ops/npu/features.py`): steps longer than the
    window, decode and mixed, equal eager, replayed, but for the windowed decode ones on a device whose
    S=1 band probe finds the band not applied at one query token per sequence (`ops/npu/band_probe.py`),
    which run eagerly. vLLM-Ascend's impl keeps no soft-cap."""
    fake = fake_torch_npu.install(monkeypatch, band_at_single_query=band_at_single_query)
    options = dict(SERVED[feature][0])
    if "sinks" in options:
        options["sinks"] = options["sinks"].to(torch.bfloat16)
    artifacts = []
    pair = Pair("ASCEND", 128, "npu", artifacts, attention_options={1: options}, verify=False)
    rng = random.Random(feature)
    for batch, mixed in [(3, False), (2, True), (4, False)]:
        got, expected = pair.run(pair.step(rng, batch, mixed, shortest=WINDOW + 4))
        torch.testing.assert_close(got, expected, **TOL[pair.dtype])
    assert sum(a.stats["replays"] for a in artifacts) == (3 if band_at_single_query or feature == "sinks" else 1)
    kernel = "npu_fused_infer_attention_score_v2.out" if feature == "sinks" else "npu_fused_infer_attention_score.out"
    featured = [c for c in fake.calls if c.name == kernel and (c.kwargs["sparse_mode"] == 4 or feature == "sinks")
                and c.kwargs.get("pre_tokens") != npu_band_probe.PROBE_WINDOW - 1]  # the probe's call left out
    assert featured and all(c.kwargs.get("learnable_sink") is not None for c in featured if feature == "sinks")
    assert all(c.kwargs["pre_tokens"] == WINDOW - 1 for c in featured if feature == "sliding window")


class FlashInferBackend(v.FlashAttentionBackend):
    """A backend the rewrite does not know (vLLM's FlashInfer metadata has no seq_lens / block_table)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"


FlashInferBackend.__module__ = "vllm.v1.attention.backends.flashinfer"

REFUSED = {
    "alibi": ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
    "encoder": ({"attn_type": "encoder_only"}, "attention type 'encoder_only'"),
}


def _refused(pair: Pair, message: str, **step) -> None:
    with pytest.raises(Exception, match=f"vLLM attention layer '{LAYER_1}': {message}") as err:
        pair.run(pair.step(random.Random(0), 3, False), **step)
    assert "is not supported by ascend_graph" in str(err.value)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
@pytest.mark.parametrize("feature", list(REFUSED))
def test_layer_features_the_rewrite_would_drop_are_refused_at_compile_time(feature, backend):
    """Each would be computed wrongly; it is refused when dynamo hands the graph over (vLLM's profile
    run), naming the layer and the feature."""
    options, message = REFUSED[feature]
    artifacts = []
    pair = Pair(backend, 16, "sim", artifacts, attention_options={1: options})
    _refused(pair, message)
    assert artifacts == []


@pytest.mark.parametrize("window, message", [
    ((7, 7), r"sliding window impl.sliding_window=\(7, 7\) \(only causal windows"),
    ((15, 0), r"sliding window layer.sliding_window=24 that the impl does not apply as such"),
])
def test_windows_the_op_cannot_express_are_refused(window, message):
    """A window reaching right of the query (FlashAttention's encoder windows), or one the impl and
    the layer disagree on, is refused rather than guessed."""
    pair = Pair("FLASH_ATTN", 16, "sim", [], attention_options={1: {"per_layer_sliding_window": WINDOW}})
    pair.models[0].attention_layers()[LAYER_1].impl.sliding_window = window
    _refused(pair, message)


@pytest.mark.parametrize("where", ["layer", "impl"])
def test_quantized_kv_cache_dtype_is_refused_at_compile_time(where):
    pair = Pair("FLASH_ATTN", 16, "sim", [])
    layer = pair.models[0].attention_layers()[LAYER_1]
    setattr(layer if where == "layer" else layer.impl, "kv_cache_dtype", "fp8_e4m3")
    _refused(pair, r"quantized KV cache \(kv_cache_dtype='fp8_e4m3'\)")


def test_quantized_kv_cache_tensor_is_refused_at_compile_time():
    pair = Pair("FLASH_ATTN", 16, "sim", [])
    layer = pair.models[0].attention_layers()[LAYER_1]
    layer.kv_cache = torch.zeros(layer.kv_cache.shape, dtype=torch.uint8)
    _refused(pair, r"quantized KV cache \(cache dtype torch.uint8\)")


def test_other_attention_backends_are_refused_by_name_at_compile_time():
    pair = Pair("FLASH_ATTN", 16, "sim", [])
    pair.models[0].attention_layers()[LAYER_1].attn_backend = FlashInferBackend
    _refused(pair, r"attention backend vllm.v1.attention.backends.flashinfer.FlashInferBackend "
                   r"\(get_name\(\) 'FLASHINFER'\)")


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
def test_non_causal_metadata_is_refused(backend, monkeypatch):
    pair = Pair(backend, 16, "sim", [])
    build = v.build_metadata

    def non_causal(model, step, **kwargs):
        metadata, slots = build(model, step, **kwargs)
        for meta in metadata.values():
            meta.causal = False
        return metadata, slots

    monkeypatch.setattr(v, "build_metadata", non_causal)
    with pytest.raises(Exception, match=r"vLLM attention layer 'model.layers.0.self_attn.attn': non-causal"):
        pair.run(pair.step(random.Random(0), 3, False))


def test_kv_transfer_connector_is_refused_at_compile_time(monkeypatch):
    """vLLM's `maybe_transfer_kv_layer` hooks run in Python around the attention op the rewrite replaces."""
    monkeypatch.setattr(integration.binder, "kv_transfer_configured", lambda: True)
    pair = Pair("FLASH_ATTN", 16, "sim", [])
    with pytest.raises(Exception, match=r"a KV-transfer connector"):
        pair.run(pair.step(random.Random(0), 3, False))


def test_vllms_compile_call_without_dynamic_gives_one_artifact_for_every_step_shape():
    """vLLM's mode 1 calls `model.compile(fullgraph=True, backend=...)` with no `dynamic=`: the
    profile run's static graph is traced again general inside dynamo's backend call, so one graph
    serves every step, batch 1 included (on vLLM's own Llama: tests/test_vllm_real.py)."""
    artifacts, calls = [], []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts)
    compile_fn = integration.backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=BUCKETS, runtime="sim"),
                                     on_compiled=artifacts.append, get_forward_context=v.get_forward_context)
    torch._dynamo.reset()
    pair.compiled = torch.compile(pair.models[0], fullgraph=True,
                                  backend=lambda gm, inputs: calls.append(1) or compile_fn(gm, inputs))
    with torch.no_grad(), v.set_forward_context(None, pair.configs[0]):  # the profile run
        pair.compiled(torch.zeros(16, dtype=torch.long), torch.arange(16))
    rng = random.Random(5)
    for batch, mixed in [(1, False), (3, False), (1, True), (2, True), (6, False)]:
        got, expected = pair.run(pair.step(rng, batch, mixed))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert len(calls) == 2 and len(artifacts) == 1 and artifacts[0].stats["replays"] == 5



def test_dynamic_batch_3_then_batch_1_with_a_rotary_view_equals_eager():
    """`torch.compile(dynamic=True)` (as `Pair` compiles): batch 3 is traced dynamic with sizes 0 and 1
    specialised, batch 1 recompiles into a static trace, traced again general inside the backend call.
    Dynamo's automatic dynamic gave ids and positions distinct symbols there; the rotary-style
    `query.view(positions.shape[0], ...)` kept the unpadded one and the capture failed (issue 36; on
    vLLM's own Llama: tests/test_vllm_real.py)."""
    artifacts = []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts, rotary=True)
    rng = random.Random(11)
    for batch, mixed in [(3, False), (1, False), (1, True), (2, True), (6, False)]:
        got, expected = pair.run(pair.step(rng, batch, mixed))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        pair.assert_caches_close()
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    assert stats["replays"] == 5 and stats["eager_fallbacks"] == 0
    assert all(not a.signature.specialized for a in artifacts)

def test_graph_memory_outside_vllms_budget_is_reported_after_each_capture(caplog):
    """vLLM sizes its KV cache before anything of ours is captured: the figure to reserve is logged."""
    artifacts = []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts)
    rng = random.Random(3)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        for batch, mixed in [(3, False), (3, False), (6, False)]:
            pair.run(pair.step(rng, batch, mixed))
    lines = [r.getMessage() for r in caplog.records if "outside vLLM's KV-cache budget" in r.getMessage()]
    assert len(lines) == 2 and "after 1 captures" in lines[0] and "after 2 captures" in lines[1]
    parts = graph_memory(artifacts[0].memory_report())
    assert parts["workspaces"] > 0 and parts["buffers"] > 0 and parts["pool"] > 0
    assert f"{sum(parts.values()) / 2 ** 20:.1f} MiB" in lines[1]
