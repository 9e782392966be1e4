"""The Ascend path on the fake of each torch_npu release the project is bound to: 2.10.0.post4 (vLLM-Ascend's pin)
and 2.14.0 (`tests/fake_torch_npu.py`, `VERSIONS`), each from the fixture read in its wheel. The model is compiled
and replayed against eager on each; each difference between the wheels that the fake plays is tested, and so is
the project's refusal of a torch_npu lacking what it calls (`ascend_compile/ops/npu/api.py`)."""
from __future__ import annotations

import dataclasses
import random
import sys
import types

import pytest
import torch

from ascend_compile.errors import AscendCompileError
from ascend_compile.ops import tiling
from ascend_compile.ops.npu import api as npu_api
from ascend_compile.runtime.npu import NpuRuntime
from examples.deepseek import build as build_deepseek
from examples.llama import LlamaConfig, PagedBatch
from tests import fake_torch_npu
from tests.test_backend import compiled_model
from tests.test_mla_npu import CFG as MLA_CFG
from tests.test_mla_npu import _run as run_mla
from tests.test_npu import DTYPE, MAX_LEN, NPU_BLOCK, assert_all_close, check_call, lengths, run_model
from tests.test_npu_device import DEVICE_CALLS, _first_step
from tests.test_npu_features import run_replayed

RELEASES = list(fake_torch_npu.VERSIONS)
LLAMA = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
#: A release the tests make up: 2.10.0.post4's fixture without the stream limits and FIA v2's query.
LACKING = "0.0.test"
DROPPED = ("get_stream_limit(", "set_stream_limit(", "_npu_fused_infer_attention_score_v2_get_max_workspace(")


@pytest.fixture(params=RELEASES)
def release_fake(request, monkeypatch):
    """The fake torch_npu of each release."""
    return fake_torch_npu.install(monkeypatch, version=request.param)


def _torch_npu():
    return sys.modules["torch_npu"]


def _made_up_release(monkeypatch, tmp_path, source: str, edit) -> str:
    """A release `LACKING` whose fixture is `source`'s with `edit` (lines -> lines) applied."""
    lines = fake_torch_npu.VERSIONS[source].fixture.read_text().splitlines()
    fixture = tmp_path / "fixture.txt"
    fixture.write_text("\n".join(edit(lines)) + "\n")
    monkeypatch.setitem(fake_torch_npu.VERSIONS, LACKING, fake_torch_npu.Release(LACKING, fixture, False))
    return LACKING


# ----------------------------------------------------------------------------- end to end on each release


def test_a_model_compiled_on_each_release_equals_eager(release_fake):
    version = release_fake.release.version
    rng = random.Random(0)
    steps = [lengths(rng, n) for n in (3, 6, 8)] + [([40, 300, 17], [3, 1, 2])]  # PA, FIA, and a mixed step
    results, artifacts = run_model(steps, LLAMA, max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    assert_all_close(results)
    art = artifacts[-1]
    assert _torch_npu().__version__ == version and art.describe()["runtime"]["torch_npu"] == version
    assert {k["kernel"] for g in art.describe()["graphs"].values() for k in g["kernels"]} == {tiling.PA, tiling.FIA}
    assert sum(a.stats["replays"] for a in artifacts) >= 3
    # Every call is one the release's own schemas take, of a function the project declares it needs.
    schemas = fake_torch_npu.schemas(version)
    for call in release_fake.calls:
        check_call(schemas[call.name], call.args, call.kwargs)
    assert {c.name.split(".")[0] for c in release_fake.calls} <= {api.name for api in npu_api.ALL_API}
    # The runtime empties both allocators itself before its first capture: it does not rely on
    # `torch.npu.graph`'s entry, which empties the host allocator from 2.14.0 on only.
    trace = [what for what, _ in release_fake.trace]
    assert {"empty_cache", "host_empty_cache"} <= set(trace[:trace.index("graph_task_group_begin")])


def test_mla_compiled_on_each_release_equals_eager(release_fake):
    steps = [([700, 5, 130], None), ([64, 128, 129, 300, 1, 900, 17], None), ([30, 900, 97], [3, 1, 4])]
    artifacts = run_mla(MLA_CFG, steps)  # each step compared with eager
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    assert release_fake.count("npu_fused_infer_attention_score_v2.out") > 0
    assert release_fake.count("_npu_fused_infer_attention_score_v2_get_max_workspace") > 0


def test_sinks_compiled_on_each_release_equal_eager(release_fake):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=True,
                      layer_types=("sliding", "full"), sliding_window=24)
    run_replayed(cfg, steps=[[300, 20, 7], ([90, 23, 300], [3, 1, 2]), [5, 24, 17, 9, 3]],
                 band_at_single_query=release_fake.band_at_single_query)  # each step compared with eager
    assert release_fake.count("npu_fused_infer_attention_score_v2.out") > 0


# ----------------------------------------------------------------------------- what each wheel offers


def test_both_releases_offer_the_project_the_same_api():
    """Read in both wheels: the same op schemas, `torch.npu` signatures and `torch_npu._C` names, line for line
    (docs/ascend.md, "torch_npu 2.10.0.post4 and 2.14.0")."""
    old, new = (fake_torch_npu.read_fixture(v) for v in ("2.10.0.post4", "2.14.0"))
    assert set(old) == set(new) == {"schema atb", "schema npu", "python torch.npu", "names torch_npu._C"}
    for section in new:
        assert old[section] == new[section], section


@pytest.mark.parametrize("version", RELEASES)
def test_each_fixture_names_the_wheel_it_was_read_from(version):
    header = "\n".join(line for line in fake_torch_npu.VERSIONS[version].fixture.read_text().splitlines()
                       if line.startswith("#"))
    assert f"torch_npu {version}" in header
    assert f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl" in header
    assert f"pip download --no-deps torch-npu=={version}" in header


@pytest.mark.parametrize("version", RELEASES)
def test_every_function_the_project_calls_is_in_the_release(version):
    """`ops/npu/api.py` against the fixture: each op overload with its keyword, each `torch.npu` function and
    `torch_npu._C` name, and nothing the runtime calls left out of it."""
    schemas, fixture = fake_torch_npu.schemas(version), fake_torch_npu.read_fixture(version)
    for api in npu_api.ALL_API:
        if api.op is not None:
            name, overload = api.op.split("::")[1].split(".")
            schema = schemas[name if overload == "default" else f"{name}.{overload}"]
            assert api.keyword is None or api.keyword in [a.name for a in schema.arguments], api
        elif api.owner == "torch.npu":
            assert api.name in fake_torch_npu.python_names(version), api
        else:
            assert api.name in fixture["names torch_npu._C"], api
    for name in ("get_stream_limit", "set_stream_limit"):  # optional: `NpuRuntime.stream_limit`
        assert name in fake_torch_npu.python_names(version)


def test_the_fake_offers_what_its_release_lists(release_fake):
    version = release_fake.release.version
    torch_npu = _torch_npu()
    assert torch_npu.__version__ == version
    names = {fn.__name__ for fn in fake_torch_npu.NPU_FUNCTIONS}
    assert names <= fake_torch_npu.python_names(version)  # the fake has nothing the release does not list
    assert {name for name in names if hasattr(torch.npu, name)} == names
    assert set(vars(torch_npu._C)) - {"__name__", "__doc__", "__package__", "__loader__", "__spec__"} == \
        set(fake_torch_npu.read_fixture(version)["names torch_npu._C"])
    ops = {key.split(".")[0] for key in fake_torch_npu.schemas(version)}
    assert {name for name in fake_torch_npu.TORCH_NPU_OPS if hasattr(torch_npu, name)} == \
        set(fake_torch_npu.TORCH_NPU_OPS) & ops
    assert npu_api.missing(torch_npu, torch.npu) == frozenset()


def test_a_release_lacking_a_function_is_played_without_it_and_the_project_copes(monkeypatch, tmp_path, caplog):
    """A fixture without the stream limits and FIA v2's query: the fake of it has neither; the runtime starts and
    serves without core limits (warning once), and an MLA model, which needs the query, is refused at compile
    naming the layer, the function and where it is offered."""
    version = _made_up_release(monkeypatch, tmp_path, "2.10.0.post4",
                               lambda lines: [line for line in lines if not line.startswith(DROPPED)])
    fake = fake_torch_npu.install(monkeypatch, version=version)
    assert not hasattr(torch.npu, "get_stream_limit") and not hasattr(torch.npu, "set_stream_limit")
    assert not hasattr(_torch_npu(), "_npu_fused_infer_attention_score_v2_get_max_workspace")
    with caplog.at_level("WARNING", logger="ascend_compile"):
        results, artifacts = run_model([[5, 6, 7], [10, 20, 30, 40, 50]], LLAMA, max_model_len=MAX_LEN,
                                       capture_sizes=(4, 8), pa_max_batch=4)
    assert_all_close(results)
    assert sum(a.stats["replays"] for a in artifacts) == 2
    assert any("get_stream_limit failed" in r.getMessage() for r in caplog.records)
    assert "set_stream_limit" not in [what for what, _ in fake.trace]
    cfg = dataclasses.replace(MLA_CFG, num_layers=1)
    fn, _ = compiled_model(build_deepseek(cfg), runtime="npu", max_model_len=256, capture_sizes=(8,))
    with pytest.raises(Exception, match=r"mla_fused_infer_attention\w* \(layer L\['self'\].layers.0.attn\): "
                                        rf"torch_npu {version} does not offer torch_npu."
                                        r"_npu_fused_infer_attention_score_v2_get_max_workspace \(offered by torch_npu "
                                        r"2.10.0.post4 and 2.14.0"), torch.no_grad():
        fn(**PagedBatch(cfg, seed=1).step([5, 6], [2, 3]))


def test_the_fake_refuses_a_release_whose_schemas_differ_from_the_defined(monkeypatch, tmp_path):
    """torch's op registry holds one schema per op, defined once per process from 2.14.0's fixture: a release
    whose schemas differ cannot be played in the same process, and says so rather than play 2.14.0's."""
    version = _made_up_release(monkeypatch, tmp_path, "2.10.0.post4", lambda lines: [
        line.replace(", *,Tensor? workspace=None", "") if line.startswith("_npu_paged_attention(") else line
        for line in lines])
    with pytest.raises(RuntimeError, match=rf"fake torch_npu {version}: atb::_npu_paged_attention.default differ"):
        fake_torch_npu.install(monkeypatch, version=version)
    assert fake_torch_npu.schema_mismatches("2.10.0.post4") == []


def test_graph_entry_empties_the_host_allocator_from_2_14_0_on(release_fake):
    """`torch.npu.graph.__enter__`: `empty_cache()` in both, `host_empty_cache()` in 2.14.0's only
    (`torch_npu/npu/graphs.py` L906; 2.10.0.post4 L861-868)."""
    with torch.npu.graph(torch.npu.NPUGraph()):
        pass
    trace = [what for what, _ in release_fake.trace]
    assert "empty_cache" in trace
    assert ("host_empty_cache" in trace) == (release_fake.release.version == "2.14.0")


# ----------------------------------------------------------------------------- a torch_npu lacking what we call


def test_a_runtime_is_refused_where_torch_npu_lacks_the_graph_api(release_fake, monkeypatch):
    monkeypatch.delattr(torch.npu, "graph_task_update_begin")
    with pytest.raises(AscendCompileError, match=r"runtime 'npu': torch_npu [\d.a-z]+ does not offer "
                                                 r"torch.npu.graph_task_update_begin \(offered by torch_npu's "
                                                 r"\*-7.0.0 release lines"):
        NpuRuntime(torch.device("cpu"))


@pytest.mark.parametrize("policy, removed, refused", [
    ("pa", "_npu_paged_attention_get_workspace", True),
    ("fia", "_npu_paged_attention_get_workspace", False),  # a graph without PA needs none of PA's functions
    ("fia", "_npu_fused_infer_attention_score_get_max_workspace", True),
    ("auto", "_npu_paged_attention_get_workspace", True),  # "auto" times PA and FIA
    ("auto", "_npu_fused_infer_attention_score_get_max_workspace", True),
])
def test_a_kernel_torch_npu_lacks_is_refused_at_compile_naming_the_layer(release_fake, monkeypatch, policy, removed,
                                                                          refused):
    monkeypatch.delattr(_torch_npu(), removed)
    error = _first_step(dataclasses.replace(LLAMA, num_layers=1), kernel_policy=policy)
    if not refused:
        assert error is None
        return
    assert isinstance(error, Exception) and f"does not offer torch_npu.{removed} (offered by" in str(error)
    where = "kernel_policy 'auto' (it times PA and FIA)" if policy == "auto" else "(layer L['self'].layers.0.attn)"
    assert where in str(error)
    assert release_fake.count(*DEVICE_CALLS) == 0  # refused before torch_npu is asked anything


def test_an_overload_without_the_workspace_keyword_or_not_registered_is_missing(release_fake):
    """A kernel's op must be registered with a schema taking `workspace=`: an `.out` overload without it (an older
    op-plugin) and ATB's ops unregistered (NNAL not sourced) are missing, and the refusal says which and why."""
    fia_out = next(line for line in fake_torch_npu.read_fixture(release_fake.release.version)["schema npu"]
                   if line.startswith("npu_fused_infer_attention_score.out("))
    older = torch._C.parse_schema(fia_out.replace("Tensor? workspace=None, ", ""))
    packet = types.SimpleNamespace(out=types.SimpleNamespace(_schema=older))
    ops = types.SimpleNamespace(npu=types.SimpleNamespace(npu_fused_infer_attention_score=packet),
                                atb=types.SimpleNamespace())
    absent = npu_api.missing(_torch_npu(), torch.npu, npu_api.PA_API + npu_api.FIA_API[:1], ops)
    assert absent == {*npu_api.PA_API, npu_api.FIA_API[0]}
    assert npu_api.missing(_torch_npu(), torch.npu, npu_api.PA_API + npu_api.FIA_API[:1]) == frozenset()
    why = npu_api.refusal(npu_api.FIA_API + npu_api.PA_API, absent, "9.9")
    assert why.startswith("torch_npu 9.9 does not offer torch_npu.npu_fused_infer_attention_score(..., workspace=)")
    assert "torch_npu._npu_paged_attention(..., workspace=) (offered by torch_npu v2.x-7.2.0" in why
    assert "source NNAL's set_env.sh" in why
    assert npu_api.refusal(npu_api.FIA_API, frozenset(), "9.9") is None
