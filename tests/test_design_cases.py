"""The three bugs of DESIGN.md §7, reproduced in the simulator with the old behaviour forced, and
shown absent with the project's real behaviour."""
from __future__ import annotations

import dataclasses

import torch

from ascend_compile.errors import ReplayError, WorkspaceTooSmall
from ascend_compile.lowering.capture import UpdateSchedule, WorkspaceLifetime
from ascend_compile.ops import tiling
from ascend_compile.targets import default_target
from ascend_compile.passes.roles import Role
from examples.llama import LlamaConfig, PagedBatch, build
from tests.test_backend import compiled_model

# Steps whose PA workspace need sits near PA's interior peak (lengths just under 4096 take 16
# splits, lengths above it take long-sequence tiling), after steps that need little. Each step fills
# its graph (3 sequences), so no padding sequence of length 1 tiles the long step short.
CASE1_STEPS = ([100, 200, 300], [8000, 7000, 8192], [3900, 3000, 2000])
# The first step is traced with a static batch of 3 (its own graph); the others, batches 2, 4 and 2,
# share dynamo's dynamic graph, served from bucket 4: two of them are padded.
STEPS = ([100, 200, 300], [900, 700], [1000, 600, 513, 77], [640, 320])


class SkipUpdates(UpdateSchedule):
    """Case 2's bug: the graph is replayed with the lengths frozen at capture (no task updates)."""

    def apply(self, table, runtime, host):
        return 0


class SkipUpdatesAndEvents(SkipUpdates):
    """... and no event in the graph to catch the missing update."""

    def guard(self, runtime, name):
        return None


class CaptureAllocatedWorkspace(WorkspaceLifetime):
    """Case 3's bug: the workspace allocated inside the capture, from the graph pool, held weakly."""

    def during_capture(self, runtime, slot, allocate):
        return runtime.weak_alias(allocate())


def with_target(**policies):
    """A target factory: the default target with some lowering policies replaced."""
    return lambda device, config: dataclasses.replace(default_target(device, config), **policies)


def run_steps(steps, cfg, target=None, **options):
    """Run `steps` compiled and eager; returns max |diff| per step, or the exception a step raised."""
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, target=target, **options)
    batch = PagedBatch(cfg, seed=2)
    results = []
    with torch.no_grad():
        for lens in steps:
            inputs = batch.step(lens)
            try:
                out = fn(**inputs)
                results.append((out - reference(**inputs)).abs().max().item())
            except Exception as e:  # noqa: BLE001 - the tests inspect it
                reference(**inputs)
                results.append(e)
    return results, artifacts


# ------------------------------------------------------- case 1: workspace sized for max_model_len

CASE1_CFG = LlamaConfig(num_layers=2, num_blocks=512, block_size=128)
#: Case 1 is about the full graphs' plan: piecewise graphs (which would serve the steps the check sends
#: away, on FIA) are off, so that the slot is the full graphs' exact maximum and refused steps run eagerly.
CASE1_OPTIONS = dict(max_model_len=8192, capture_sizes=(4,), kernel_policy="pa", piecewise_sizes=[])


def test_case1_workspace_pinned_at_max_model_len_fails_at_replay():
    results, artifacts = run_steps(CASE1_STEPS, CASE1_CFG, workspace_seq_len=8192, sim_overflow="raise", **CASE1_OPTIONS)
    assert results[0] < 1e-5 and results[1] < 1e-5  # short and long steps fit the pinned size
    assert isinstance(results[2], WorkspaceTooSmall)
    assert "needs 9792 bytes" in str(results[2]) and "given 6528 bytes" in str(results[2])
    # the worst step of the graph (3 sequences) mixes long and short ones: every long one is tiled short
    assert "a step of KV lengths [7937, 7937, 3841] needs 21760" in artifacts[-1].rewritten.plan.warnings()[0]


def test_case1_overrun_writes_into_the_neighbouring_buffers_like_the_device():
    results, _ = run_steps(CASE1_STEPS, CASE1_CFG, workspace_seq_len=8192, **CASE1_OPTIONS)
    # The overrun lands on the next static input buffer (slot_mapping): the next layer reads garbage.
    assert isinstance(results[2], ValueError) and "slot_mapping" in str(results[2])


def test_case1_exact_maximum_serves_every_length():
    results, artifacts = run_steps(CASE1_STEPS, CASE1_CFG, sim_overflow="raise", **CASE1_OPTIONS)
    assert all(isinstance(r, float) and r < 1e-5 for r in results), results
    slot = artifacts[-1].rewritten.plan.slots["attn_workspace"]
    assert slot.exact_argmax_batch == (7937, 7937, 3841) and not slot.undersized
    # alone, the need of one length still peaks inside [1, max_model_len], at 3841
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
    assert tiling.max_uniform_workspace(tiling.PA, shape, 3, 8192).argmax_len == 3841


def test_case1_steps_mixing_long_and_short_sequences_are_served_by_the_exact_maximum():
    # Padded into bucket 4, three long sequences share a step with a padding sequence of KV length 1:
    # PA tiles them all short, needing more than any step of one length; the plan sized for every
    # mix serves it, and the worst mix, without an overrun.
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
    uniform = tiling.max_uniform_workspace(tiling.PA, shape, 4, 8192)
    assert tiling.workspace_nbytes(tiling.PA, shape, [8000, 7990, 8100, 1]) > uniform.nbytes
    steps = ([100, 200], [8000, 7990, 8100], [7937, 7937, 7937, 3841], [8000] * 4, [3900, 3000])
    results, artifacts = run_steps(steps, CASE1_CFG, sim_overflow="raise", **CASE1_OPTIONS)
    assert all(isinstance(r, float) and r < 1e-5 for r in results), results
    slot = artifacts[-1].rewritten.plan.slots["attn_workspace"]
    assert slot.nbytes == tiling.max_workspace(tiling.PA, shape, 4, 8192).nbytes > uniform.nbytes
    assert sum(a.stats["replays"] for a in artifacts) >= 3


# ------------------------------------------------------- case 2: stale host lengths

CFG = LlamaConfig(num_layers=3, num_blocks=512)
OPTIONS = dict(max_model_len=1024, capture_sizes=(4,), kernel_policy="pa")


def test_case2_skipped_update_hits_the_missing_event_error():
    results, _ = run_steps(STEPS, CFG, target=with_target(updates=SkipUpdates()), **OPTIONS)
    for r in results:
        assert isinstance(r, ReplayError)
        assert "'paged_attention_default'" in str(r) and "never recorded" in str(r)


def test_case2_skipped_update_without_events_reads_stale_lengths():
    results, _ = run_steps(STEPS, CFG, target=with_target(updates=SkipUpdatesAndEvents()), **OPTIONS)
    assert all(isinstance(r, float) and r > 0.1 for r in results), results


def test_case2_updates_refresh_lengths_every_step():
    results, _ = run_steps(STEPS, CFG, **OPTIONS)
    assert all(isinstance(r, float) and r < 1e-5 for r in results), results


# ------------------------------------------------------- case 3: workspace lifetime


def test_case3_weakly_held_workspace_is_aliased_and_corrupts_the_output():
    results, _ = run_steps(STEPS, CFG, target=with_target(workspaces=CaptureAllocatedWorkspace()), **OPTIONS)
    assert all(isinstance(r, float) and r > 0.1 for r in results), results


def test_case3_artifact_owned_workspace_is_never_aliased():
    results, artifacts = run_steps(STEPS, CFG, **OPTIONS)
    assert all(isinstance(r, float) and r < 1e-5 for r in results), results
    art = artifacts[-1]
    workspace = art.workspaces["attn_workspace"]
    assert art.runtime.address_of(workspace)[0] == "general"  # not in the graph pool captures reuse


# ------------------------------------------------------- padding, bucket choice, outputs


def test_steps_smaller_than_the_bucket_are_padded_and_served_by_the_smallest_bucket():
    results, artifacts = run_steps(STEPS + ([30, 40, 50],), CFG, **dict(OPTIONS, capture_sizes=(2, 4)))
    assert all(isinstance(r, float) and r < 1e-5 for r in results), results
    art = artifacts[-1]
    # Batches of 2 replay bucket 2; of 4 and 3 (one padding sequence) bucket 4.
    assert {str(key) for key, _ in art.graphs} == {"b2.decode", "b4.decode"}
    assert art.stats["replays"] == 4 and art.stats["eager_fallbacks"] == 0


def test_padding_sequences_have_length_0_in_the_static_seq_lens_buffer():
    # DESIGN.md §5: seq_lens pads with 0, a sequence the kernels treat as empty. The host lengths
    # the Ascend kernels take give padding KV length 1 (never 0, see lowering/inputs.py); the device
    # buffer, which CUDA's device-length kernels read, must still say 0.
    cfg = LlamaConfig(num_layers=1, num_blocks=512)
    fn, artifacts = compiled_model(build(cfg), **OPTIONS)
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        for lens in ([5, 6, 7], [1000, 600, 513, 77], [50, 60]):  # block tables of 1, 63 and 4 blocks
            fn(**batch.step(lens))
    art = artifacts[-1]
    (graph,) = art.graphs.values()
    (spec,) = art.signature.by_role(Role.SEQ_LENS)
    assert art.stats["replays"] == 2 and graph.staging.buffers[spec.index].tolist() == [50, 60, 0, 0]


def test_clone_outputs_true_returns_copies_the_next_step_leaves_alone():
    cfg = LlamaConfig(num_layers=1, num_blocks=512)
    fn, artifacts = compiled_model(build(cfg), **OPTIONS)
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        fn(**batch.step([5, 6, 7]))
        first = fn(**batch.step([8, 9]))
        kept = first.clone()
        second = fn(**batch.step([10, 11]))
    (graph,) = artifacts[-1].graphs.values()
    static = {o.untyped_storage().data_ptr() for o in graph.outputs if isinstance(o, torch.Tensor)}
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert first.untyped_storage().data_ptr() not in static

