"""Protocol mutants: put back, one at a time, a bug the tests must catch, and run the tests that should.

    python tools/mutants.py [--only NAME ...] [--changed-since BASE] [--list]

Each mutant is one textual edit of the package (in a scratch copy of the repository, never in place)
and the tests that must fail with it. A mutant is **caught** when those tests fail, **survived**
when they pass. The list holds the four bugs a mutation audit of the runner found the suite blind
to (issue 11: an event recorded before its update, the event reset not captured, FIA captured without
its event wait, the device seq_lens buffer padded unlike the host lengths) and one of each class of
bug the audit's other mutants were (skipped update, stale padding, weak workspace, capture-time
sizing, wrong bucket, missing address check, no clone, updates after synchronize), the random-number
bugs of issue 24 (a capture or a warm-up consuming the step's generator, replays reusing the capture's
draws), the twelve a second audit's mutants survived (issue 27: overlapping writes, shrinking regions,
padding KV lengths, host scalars, metadata keys, the transformers block table, vLLM's query_start_loc,
collectives in flight, per-sequence outputs, empty queries on the device path, the workspace scan's
top end, decode detection), issue 22's (`verify` comparing nothing; what an Ascend device requires
that the fake torch_npu now checks: a cache write reading device data on the host, a skipped
contiguity check, the PA block-size check removed; the simulator's rules: a host read inside an op,
a replay running an op's Python body, PA sized for batches of one length only; mixed steps padded a
sequence per token, PA's workspace not asked at each step's lengths), the attention features' bugs
(issue 25), MLA's (issue 26: the kernels', its Triton kernels' included, the vLLM binding's, whose
tests run vLLM's own code in the vLLM venv, `VLLM_PYTHON`, and on runtime "npu": its lengths,
workspace, sparse modes, mixed capture, the 16-token rule and a compile-time rule) and issue 23's vLLM
ones (another backend not refused, the first vLLM graph not traced general, a window, soft-cap or
sinks not passed to the op, FlashAttention's window off by one, vLLM-Ascend's int32 slots copied to
int64 each step, its host copies of the lengths not taken or taken unchecked), and the ten a third
audit's mutants survived (issue 36: MLA's dummy limit, the overlap of staged and in-place inputs, PA's
per-step check against another bucket's slot, vLLM-Ascend's query ends
one too many, `has_sink` without `impl.sinks`, the vLLM block table not cut, the NPU generator not
kept, the simulator's static inputs after an update, a uint8 mask index), and issue 33's (an uncapturable op,
float32 on npu, verify's memory and `verify_every`, the device limits, FIA's decode graphs serving mixed
steps, its two branches one task kind to the simulator; a window or sinks on runtime "npu": the band off
by one or sent causal, sinks dropped, their rules not refused, the workspace asked without them, the
fake's band semantics and constraints; and the band at one query token per sequence: the device's probe
assumed to answer yes, its answer not guarded per step, the binding's backstop dropped, the fake against
its docs there).

Prints a table and a last line `N caught, M survived`; exits 1 if any survived, 2 if a mutant's edit
no longer applies (the code moved: update the mutant).

Kept beside the generated mutants (mutmut, `tools/mutation_ci.py`), for the bugs mutmut's operators cannot
write. mutmut changes one expression in place (an operator, a constant, a name, a string, an argument
dropped or set to None, an assignment's value), inside the package, with the tests run in its own venv.
These are not that: statements removed or moved (a reset or a wait not captured, an event recorded before
its update, updates after the synchronize: 44 of the 271 delete a statement), a branch switched off or a
condition dropped from a test (`if x:` to `if False:`, `A or B` to `A`: 45), several lines edited as one
bug (30), edits outside the package (the fake torch_npu's and the simulator's rules in `tests/`, the
mutant selection in `tools/`, the example model: 15), and the vLLM bindings' bugs whose tests run vLLM's
own code in its venvs (27). A bug mutmut can write is left to it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The interpreter of the venv with vLLM (`.ci/vllm-venv` builds `.venv-vllm`), for mutants whose
#: tests run vLLM's own code; `ASCEND_COMPILE_VLLM_PYTHON` names another.
VLLM_PYTHON = Path(os.environ.get("ASCEND_COMPILE_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
#: The same for vLLM 0.33 (`.ci/vllm33-venv` builds `.venv-vllm33`; `ASCEND_COMPILE_VLLM33_PYTHON` names another).
VLLM33_PYTHON = Path(os.environ.get("ASCEND_COMPILE_VLLM33_PYTHON") or ROOT / ".venv-vllm33" / "bin" / "python")
#: What the scratch copy needs to import the package and run its tests.
COPIED = ("ascend_compile", "tests", "examples", "tools", "pyproject.toml", "setup.py")


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One bug: replace `old` (which must occur exactly once in `path`) by `new`; `tests` must fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    vllm: bool = False  # the tests run vLLM's own code: in the vLLM venv (`VLLM_PYTHON`)
    vllm33: bool = False  # ... vLLM 0.33's: in its venv (`VLLM33_PYTHON`)


CASE2 = "tests/test_design_cases.py::test_case2_updates_refresh_lengths_every_step"
PADDING = "tests/test_design_cases.py::test_padding_sequences_have_length_0_in_the_static_seq_lens_buffer"
BUCKETS = "tests/test_design_cases.py::test_steps_smaller_than_the_bucket_are_padded_and_served_by_the_smallest_bucket"
PROTOCOL_FIA = "tests/test_npu.py::test_replay_is_launched_before_the_updates_which_record_the_events"
AUDIT = "tests/test_audit_survivors.py"
SEEDED = "tests/test_rng.py::test_seeded_sampling_matches_eager_on_capture_and_replay_steps"
ONE_SEED = "tests/test_rng.py::test_one_seed_then_steps_at_bucket_sizes_draw_eager_s_stream"
TRITON = "tests/test_triton_kernels.py"
PIECEWISE = "tests/test_piecewise.py"
TRITON_MLA = "tests/test_triton_mla.py"
DEVICE = "tests/test_npu_device.py"
MLA_REAL = "tests/test_vllm_mla_real.py::test_vllms_deepseek_v2_through_vllms_compile_call_equals_eager"
NPU_MLA = "tests/test_mla_npu.py"
NPU_FEATURES = "tests/test_npu_features.py"
CAPTURE_FAILURES = "tests/test_capture_failures.py"
GRAPH_BUDGET = "tests/test_graph_budget.py"
WARM_START = "tests/test_warm_start.py"
NPU_BAND_EDGE = "tests/test_npu_band_edge.py"
VLLM_FEATURES = "tests/test_vllm.py::test_layer_features_are_passed_to_the_attention_op_and_served_equal_to_eager"
VLLM_REAL = "tests/test_vllm_real.py"
AUDIT36 = "tests/test_audit36_survivors.py"
UNCAPTURABLE = "tests/test_uncapturable.py"
DIFFERENTIAL = "tests/test_differential.py"
FAILED_STEPS = "tests/test_failed_steps.py"

MUTANTS_CHANGED = "tests/test_mutants_changed.py"
KERNEL_RULES = "tests/test_npu_kernel_rules.py"
GROUP = "tests/test_workspace_group.py"
GROUP_REPLAYS = f"{GROUP}::test_target_and_drafter_share_one_slot_and_pool_replaying_alternately_equal_to_eager"
EAGLE = "tests/test_vllm_eagle.py"

MUTANTS = (
    Mutant(
        "a layer's vLLM cache views are carried from one step's read to the next unchecked",
        "ascend_compile/integrations/vllm/context.py",
        "        if self._checked is not None and self._checked == PASS.current:\n",
        "        if self._pair is not None:\n",
        ("tests/test_vllm_cache_views.py",),
    ),
    Mutant(
        "the live capture runs a node writing a caller's tensor again: its segment does not read the flag",
        "ascend_compile/passes/split_pieces.py",
        "        return _writes_caller(self.why)\n",
        "        return False\n",
        ("tests/test_piecewise_live.py::test_a_node_writing_a_callers_tensor_runs_once_per_step_not_in_the_capture_too",),
    ),
    Mutant(
        "FIA's workspace is asked in the packed form only, never a decode step's one-query-token form",
        "ascend_compile/ops/npu/workspace_queries.py",
        "        return max(packed, self._fia_asked(shape, tokens, max_blocks, features, [1] * tokens, fia_decode_kv_lens(tokens)))\n",
        "        return packed\n",
        ("tests/test_npu_fake_forms.py::test_fias_workspace_plan_holds_every_form_its_graph_calls",),
    ),
    Mutant(
        "a windowed decode call keeps the band where the device's one-query-token band is not the window",
        "ascend_compile/ops/npu/kernels.py",
        "            pre_tokens = None  # no band where the device's S=1 band is not the window: every key, within the window\n",
        "            pass\n",
        ("tests/test_npu_fake_forms.py::test_a_windowed_model_on_a_broken_one_query_token_band_runs_its_long_decode_steps_eagerly",),
    ),
    Mutant(
        "undo reads a layer's halves one element apart", "ascend_compile/lowering/undo.py",
        "    delta = value.storage_offset() - key.storage_offset()\n",
        "    delta = min(1, value.storage_offset() - key.storage_offset())\n",
        ("tests/test_undo_layouts.py",),
    ),
    Mutant(
        "vLLM steps direct by default no more", "ascend_compile/integrations/vllm/options.py",
        'DEFAULTS: dict[str, Any] = {"frozen_parameters": True, "dispatch": "direct"}',
        'DEFAULTS: dict[str, Any] = {"frozen_parameters": True, "dispatch": "dynamo"}',
        ("tests/test_vllm_real.py::test_steps_after_the_first_compiled_one_skip_dynamo_and_a_failed_check_goes_through_it",),
        vllm33=True,  # the fast path is armed on vLLM 0.33's torch 2.14, not on 0.23's 2.11
    ),
    Mutant(
        "direct vLLM steps skip the deferred compile's per-step checks", "ascend_compile/integrations/vllm/deferred.py",
        "        return self._step(args, direct=True, fixed=fixed)\n",
        "        return self.compiled.call_direct(args, fixed)\n",
        ("tests/test_vllm_real.py::test_a_request_longer_than_our_max_model_len_runs_as_traced_not_failing_the_engine",),
        vllm33=True,  # the fast path is armed on vLLM 0.33's torch 2.14, not on 0.23's 2.11
    ),
    Mutant(
        "the simulator runs c10d's collectives at capture only, never at replay", "ascend_compile/runtime/sim/kernels.py",
        'TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d"})\n',
        'TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional"})\n',
        ("tests/test_tensor_parallel.py::test_every_step_on_every_rank_matches_the_unsplit_model",),
    ),
    Mutant(
        "a direct call writes its inputs into the route's list while another call holds it",
        "ascend_compile/dispatch/route.py",
        "        if self._fill is not None and self._filling.acquire(False):\n",
        "        if self._fill is not None and (self._filling.acquire(False) or True):\n",
        ("tests/test_direct_dispatch.py::test_concurrent_direct_callers_each_get_their_own_inputs",),
    ),
    Mutant(
        "a direct call runs with tensor-subclass dispatch on", "ascend_compile/dispatch/route.py",
        "            if self.torch_function_disabled:\n",
        "            if False:\n",
        ("tests/test_vllm_fast_path.py",),
    ),
    Mutant(
        "a guard on the forward context stood in for", "ascend_compile/integrations/vllm/fast_path.py",
        "        if PER_STEP.search(source) or PER_STEP.search(code):\n",
        "        if PER_STEP.search(source):\n",
        ("tests/test_vllm_fast_path.py",),
    ),
    Mutant(
        "a guard inside a step argument stood in for", "ascend_compile/integrations/vllm/fast_path.py",
        "        elif source != match.group(0):\n",
        "        elif False:\n",
        ("tests/test_vllm_fast_path.py",),
    ),
    # CI's selection of mutants (tools/mutants_changed.py): a rule dropped lets a change through unchecked
    Mutant(
        "mutant selection ignores its tests", "tools/mutants_changed.py",
        "        elif any(t.split(\"::\")[0] in changed for t in m.tests):\n", "        elif False:\n",
        (f"{MUTANTS_CHANGED}::test_a_sibling_module_or_a_test_file_changed_runs_its_mutants_only",),
    ),
    Mutant(
        "mutant selection ignores the pins", "tools/mutants_changed.py",
        "    if path == \"pyproject.toml\":  # its pins, not its entry points or tool settings\n",
        "    if path == \"pyproject.toml\" and False:\n",
        (f"{MUTANTS_CHANGED}::test_pyproject_counts_for_its_requirements_not_its_entry_points",),
    ),
    Mutant(
        "mutant selection counts saved examples as code", "tools/mutants_changed.py",
        "    if path.startswith(HYPOTHESIS_DB):", "    if False:",
        (f"{MUTANTS_CHANGED}::test_what_every_test_stands_on_runs_every_mutant",),
    ),
    # issue 36: what the differential tester found (tests/test_differential.py)
    Mutant(
        "reference-fia-zero-query-tokens",
        "ascend_compile/ops/reference.py",
        "if num_seqs == 0 or max(kv_lens) == 0 or query.shape[0] == 0:",
        "if num_seqs == 0 or max(kv_lens) == 0:",
        ("tests/test_ops.py::test_a_step_with_no_query_tokens_attends_nothing",),
    ),
    Mutant(
        "dummy-longer-than-a-table-row",
        "ascend_compile/passes/padding.py",
        "        limit = min(limit, evaluate(size_expr(table.shape[1]), padded) * int(cache.shape[1]))",
        "        limit = min(limit, PADDING_CHUNK + 0 * evaluate(size_expr(table.shape[1]), padded))",
        (f"{DIFFERENTIAL}::test_dummy_sequences_fit_the_block_table_when_max_model_len_is_below_the_padding_chunk",),
    ),
    Mutant(
        "event recorded before the update", "ascend_compile/lowering/capture.py",
        "            if not persist or not entry.sources.isdisjoint(changed):\n"
        "                with runtime.task_update(entry.handle):\n                    entry.impl(*entry.arguments(host))\n"
        "                count += 1\n            if entry.event is not None:\n                entry.event.record()\n",
        "            if entry.event is not None:\n                entry.event.record()\n"
        "            if not persist or not entry.sources.isdisjoint(changed):\n"
        "                with runtime.task_update(entry.handle):\n                    entry.impl(*entry.arguments(host))\n"
        "                count += 1\n",
        (CASE2,),
    ),
    Mutant(
        "event reset not captured", "ascend_compile/lowering/capture.py",
        "        event.wait()\n        event.reset()\n", "        event.wait()\n", (CASE2,),
    ),
    Mutant(
        "FIA captured without an event wait", "ascend_compile/lowering/capture.py",
        "        event = self.schedule.guard(runtime, n.name)\n",
        "        event = self.schedule.guard(runtime, n.name) if call.meta.kernel == \"paged_attention\" else None\n",
        (PROTOCOL_FIA,),
    ),
    Mutant(
        "device seq_lens padded with 7", "ascend_compile/passes/roles.py",
        "    Role.SEQ_LENS: 0,\n", "    Role.SEQ_LENS: 7,\n", (PADDING,),
    ),
    Mutant(
        "skipped update", "ascend_compile/lowering/capture.py",
        "                with runtime.task_update(entry.handle):\n                    entry.impl(*entry.arguments(host))\n",
        "                pass\n", (CASE2,),
    ),
    Mutant(
        "stale padding", "ascend_compile/lowering/inputs.py",
        "            copies.append((region, pad.expand(region.shape)))\n", "            pass\n", (PADDING,),
    ),
    Mutant(
        "weak workspace", "ascend_compile/lowering/capture.py",
        "        return slot\n", "        return runtime.weak_alias(allocate())\n",
        ("tests/test_design_cases.py::test_case3_artifact_owned_workspace_is_never_aliased",),
    ),
    Mutant(
        "workspace sized at one length", "ascend_compile/ops/tiling.py",
        "    lens = torch.arange(1, max_model_len + 1, dtype=torch.int64)\n",
        "    lens = torch.tensor([max_model_len], dtype=torch.int64)\n",
        ("tests/test_design_cases.py::test_case1_exact_maximum_serves_every_length",),
    ),
    Mutant(
        "wrong bucket", "ascend_compile/lowering/inputs.py",
        "    i = bisect.bisect_left(buckets, tokens)\n", "    i = bisect.bisect_right(buckets, tokens)\n", (BUCKETS,),
    ),
    Mutant(
        "missing address check", "ascend_compile/lowering/input_checks.py",
        "            moved = [i for i, ptr in self.addresses.items() if args[i].data_ptr() != ptr]\n",
        "            moved = []\n",
        ("tests/test_backend.py::test_moved_kv_cache_is_recaptured_not_read_stale",),
    ),
    Mutant(
        "no clone", "ascend_compile/lowering/outputs.py",
        "    return tuple(aliased[i] if i in aliased else out.clone() if clone and isinstance(out, torch.Tensor) else out\n",
        "    return tuple(aliased[i] if i in aliased else out\n",
        ("tests/test_design_cases.py::test_clone_outputs_true_returns_copies_the_next_step_leaves_alone",),
    ),
    Mutant(
        "capture consumes the generator", "ascend_compile/runtime/sim/runtime.py",
        "            with generators_kept(), mode.guard, mode:\n",
        "            with mode.guard, mode:\n",
        (SEEDED, ONE_SEED, "tests/test_rng.py::test_capture_step_leaves_the_generator_where_a_replay_step_does"),
    ),
    Mutant(
        "warm-up consumes the generator", "ascend_compile/runtime/npu.py",
        "        with rt.generators_kept():\n            run()\n", "        run()\n",
        ("tests/test_rng.py::test_seeded_sampling_matches_eager_on_npu_whose_warm_up_runs_the_step",),
    ),
    Mutant(
        "replays reuse the capture's draws", "ascend_compile/runtime/sim/runtime.py",
        "        saved = snapshot(self._static_inputs())\n",
        "        saved = snapshot(self._static_inputs())\n"
        "        self.__dict__.setdefault(\"_rng\", torch.random.get_rng_state())  # the state the capture left\n"
        "        queue.enqueue(stream, CallWork(\"rng\", lambda s: torch.random.set_rng_state(self._rng)))\n",
        (SEEDED, ONE_SEED, "tests/test_rng.py::test_replays_draw_fresh_numbers_without_reseeding"),
    ),
    Mutant(
        "updates after synchronize", "ascend_compile/lowering/graph_entry.py",
        "        self.graph.replay()\n", "        self.graph.replay()\n        runtime.after_replay()\n", (CASE2,),
    ),
    # issue 27: the mutation audit's survivors
    Mutant(
        "overlap check keeps the first write only", "ascend_compile/passes/write_back.py",
        "        seen[index] = seen[index] | elements if index in seen else elements\n",
        "        seen.setdefault(index, elements)\n",
        (f"{AUDIT}::test_a_write_overlapping_an_earlier_one_only_when_padded_runs_eagerly",),
    ),
    Mutant(
        "a region grows if any coefficient does", "ascend_compile/passes/roles.py",
        "        return all(c >= 0 for c in sympy.Poly(", "        return any(c >= 0 for c in sympy.Poly(",
        (f"{AUDIT}::test_clearing_the_rest_of_a_buffer_is_captured_per_exact_size",),
    ),
    Mutant(
        "host scalars checked only when an address moved", "ascend_compile/lowering/input_checks.py",
        "            moved = [i for i, ptr in self.addresses.items() if args[i].data_ptr() != ptr]\n"
        "        if values and list(map(torch.Tensor.item, pick_scalars(args))) != values:\n",
        "            moved = [i for i, ptr in self.addresses.items() if args[i].data_ptr() != ptr]\n"
        "        if moved and list(map(torch.Tensor.item, pick_scalars(args))) != values:\n",
        (f"{AUDIT}::test_a_changed_host_scalar_is_not_replayed_with_its_capture_value",),
    ),
    Mutant(
        "metadata deduplication ignores keyword arguments", "ascend_compile/passes/hoist_metadata.py",
        "(node.args, tuple(sorted(node.kwargs.items())))", "(node.args, ())",
        (f"{AUDIT}::test_metadata_differing_only_in_a_keyword_argument_is_not_merged",),
    ),
    Mutant(
        "narrowed outputs cached per token count", "ascend_compile/lowering/graph_entry.py",
        "        return per_step_shape(self._output_views, tuple(symbols.values()),\n",
        "        return per_step_shape(self._output_views, (symbols[self.staging.signature.tokens],),\n",
        (f"{AUDIT}::test_outputs_sized_by_the_sequence_count_follow_it_when_the_token_count_repeats",),
    ),
    Mutant(
        "decode from the last query offset alone", "ascend_compile/lowering/inputs.py",
        "        decode = decode and loc == _decode_start_loc(len(loc))\n",
        "        decode = decode and loc[-1] == len(loc) - 1\n",
        (f"{AUDIT}::test_a_sequence_with_no_query_tokens_is_not_served_as_decode",),
    ),
    Mutant(
        "padding sequences sent KV length 0", "ascend_compile/lowering/inputs.py",
        "    return tuple(max(1, b - a) for a, b in zip(ends[-count - 1:], ends[-count:])) if count else ()\n",
        "    return (0,) * count\n",
        (f"{AUDIT}::test_padding_sequences_are_sent_their_query_length_as_kv_length",),
    ),
    Mutant(
        "transformers block table rounded down", "ascend_compile/integrations/transformers.py",
        "    model.config.ascend_max_blocks = -(-ascend_config.max_model_len // page_size)\n",
        "    model.config.ascend_max_blocks = ascend_config.max_model_len // page_size\n",
        (f"{AUDIT}::test_transformers_sequences_up_to_a_max_model_len_off_the_page_size_keep_their_last_page",),
    ),
    Mutant(
        "vLLM query_start_loc not narrowed", "ascend_compile/integrations/vllm/context.py",
        "    return metadata.query_start_loc[: metadata.seq_lens.shape[0] + 1]\n",
        "    return metadata.query_start_loc\n",
        ("tests/test_vllm.py::test_query_start_loc_longer_than_the_step_is_cut_to_its_sequences",),
    ),
    Mutant(
        "collective output written before its wait", "ascend_compile/runtime/sim/collectives.py",
        "            poison(dst)\n", "            poison(dst)\n            dst.copy_(result)\n",
        ("tests/test_sim.py::test_a_collectives_output_read_before_its_wait_is_poison",),
    ),
    Mutant(
        "device check accepts empty queries", "ascend_compile/lowering/inputs.py",
        "            torch._assert_async((loc[1:] - loc[:-1]).min() >= 1,\n",
        "            torch._assert_async((loc[1:] - loc[:-1]).min() >= 0,\n",
        ("tests/test_triton_kernels.py::test_cuda_device_checks_refuse_a_sequence_with_no_query_tokens",),
    ),
    Mutant(
        "workspace scan stops short of max_model_len", "ascend_compile/ops/tiling.py",
        "    lens = torch.arange(1, max_model_len + 1, dtype=torch.int64)\n",
        "    lens = torch.arange(1, max(2, max_model_len), dtype=torch.int64)\n",
        (f"{AUDIT}::test_a_sequence_of_exactly_max_model_len_fits_its_workspace",),
    ),
    Mutant(
        "verify compares nothing", "ascend_compile/lowering/verify.py",
        "    if bool((err <= rtol * norm + atol * rows(e).shape[1] ** 0.5).all()):\n",
        "    if True:\n",
        ("tests/test_verify.py::test_stale_lengths_are_caught_at_the_first_replay_and_every_step_stays_right",),
    ),
    # issue 25: attention features
    Mutant(
        "window ignored by the reference kernel", "ascend_compile/ops/reference.py",
        "        allowed = allowed & (key_pos > query_pos - features.window)\n", "        pass\n",
        ("tests/test_features.py::test_features_equal_the_dense_oracle",),
    ),
    Mutant(
        "a windowed layer keeps the bucket's PA", "ascend_compile/ops/kernel_policy.py",
        "    if not features.plain:\n", "    if False:\n",
        ("tests/test_features.py::test_the_eager_op_runs_fia_for_a_featured_decode_batch",
         "tests/test_features.py::test_a_model_mixing_full_and_windowed_layers_takes_pa_per_layer_where_it_can"),
    ),
    Mutant(
        "sinks dropped from the combine", "ascend_compile/ops/reference.py",
        "    if features.sinks:\n        # each head", "    if False:\n        # each head",
        ("tests/test_features.py::test_features_equal_the_dense_oracle",),
    ),
    Mutant(
        "a window's blocks read from the sequence start", "ascend_compile/ops/reference.py",
        "    kv_idx = torch.where(kv_valid, start + offset, start.expand_as(offset))\n",
        "    kv_idx = torch.where(kv_valid, start + offset, torch.zeros_like(offset))\n",
        ("tests/test_features.py::test_blocks_before_a_window_are_never_read",),
    ),
    Mutant(
        "transformers sliding window not passed", "ascend_compile/integrations/transformers.py",
        "    window = kwargs.get(\"sliding_window\") if kwargs[\"ascend_sentinel\"] is not None else None\n",
        "    window = None\n",
        ("tests/test_transformers_cb.py::test_generate_batch_equals_greedy_generate_with_graphs_replayed[mistral]",),
    ),
    Mutant(
        "transformers ring left at the window", "ascend_compile/integrations/transformers.py",
        "        allocator.sliding_window = ring_length(", "        allocator.sliding_window_unused = ring_length(",
        ("tests/test_transformers_cb.py::test_generate_batch_equals_greedy_generate_with_graphs_replayed[mistral]",),
    ),
    # issue 25: the features in the Triton kernels (interpreted on the CPU)
    Mutant(
        "triton window ignored", "ascend_compile/ops/cuda_triton.py",
        "    switches = dict(WINDOW=window is not None, HAS_SINKS=sinks is not None)\n",
        "    switches = dict(WINDOW=False, HAS_SINKS=sinks is not None)\n",
        (f"{TRITON}::test_triton_features_match_dense[window5-decode]",),
    ),
    Mutant(
        "triton sink added per split", "ascend_compile/ops/cuda_triton.py",
        "            if n == 1:\n                if HAS_SINKS:  # the whole softmax is here: its sink joins the denominator now\n"
        "                    sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E\n"
        "                    result = result * _sink_share(m_i, l_i, sink)[:, None]\n",
        "            if HAS_SINKS:\n                sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E\n"
        "                result = result * _sink_share(m_i, l_i, sink)[:, None]\n            if n == 1:\n",
        (f"{TRITON}::test_triton_features_match_dense[sinks-decode]",),
    ),
    Mutant(
        "triton reads keys before the span", "ascend_compile/ops/cuda_triton_device.py",
        "            kv_ok = (key_pos >= kv_start) & (key_pos < kv_len)\n", "            kv_ok = key_pos < kv_len\n",
        (f"{TRITON}::test_triton_window_never_reads_blocks_before_the_span[decode-16]",),
    ),
    Mutant(
        "triton soft-cap on base-2 logits", "ascend_compile/ops/cuda_triton.py",
        "window or 0, (soft_cap or 1.0) * LOG2E.value,", "window or 0, (soft_cap or 1.0),",
        (f"{TRITON}::test_triton_features_match_dense[soft_cap-decode]",),
    ),
    # issue 22: what an Ascend device requires
    Mutant(
        "a cache write with a host read", "ascend_compile/ops/npu/kernels.py",
        "        library.check_cache_write(key, value, key_cache, value_cache, slot_mapping)\n"
        "        self.torch_npu.npu_scatter_pa_kv_cache(",
        "        library.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)\n"
        "        self.torch_npu.npu_scatter_pa_kv_cache(",
        (f"{DEVICE}::test_the_cache_write_binding_reads_no_device_data_on_the_host",),
    ),
    Mutant(
        "skipped contiguity check", "ascend_compile/ops/npu/rules.py",
        "        if not tensor.is_contiguous():\n", "        if False:\n",
        (f"{DEVICE}::test_a_non_contiguous_kv_cache_is_refused_at_compile",),
    ),
    Mutant(
        "PA block size check removed", "ascend_compile/passes/npu_checks.py",
        "        _refuse(call.node, lambda: npu_rules.check_pa_block_size(block_size))\n", "        pass\n",
        (f"{DEVICE}::test_a_pa_block_size_of_256_is_refused_at_compile",),
    ),
    # issue 22: the simulator as strict as the device
    Mutant(
        "a host read inside an op not refused in capture", "ascend_compile/runtime/sim/dispatch.py",
        "        if syncs_host(func, args, kwargs) and any(\n",
        "        if syncs_host(func, args, kwargs) and not self.guard.enclosing and any(\n",
        ("tests/test_sim.py::test_a_host_read_inside_a_custom_op_fails_the_capture_naming_the_op_and_the_read",),
    ),
    Mutant(
        "replay re-runs an op's Python body", "ascend_compile/runtime/sim/kernels.py",
        "        return op.namespace in TORCH_NAMESPACES or op.namespace in self.names or op._schema.name in self.names\n",
        "        return True\n",
        ("tests/test_sim.py::test_a_custom_op_is_recorded_as_the_ops_its_body_issues_and_replays_run_none_of_its_python",),
    ),
    Mutant(
        "PA sized for uniform batches only", "ascend_compile/ops/tiling.py",
        "    mixed = one_short + (tokens - 1) * any_short\n", "    mixed = tokens * one_short\n",
        ("tests/test_design_cases.py::test_case1_steps_mixing_long_and_short_sequences_are_served_by_the_exact_maximum",),
    ),
    Mutant(
        "mixed steps padded one sequence per token", "ascend_compile/lowering/inputs.py",
        "    if not step.decode:\n        dummies = _dummies(step, geometry)\n",
        "    if False:\n        dummies = _dummies(step, geometry)\n",
        ("tests/test_npu_device.py::test_a_mixed_step_sends_fia_its_sequences_and_a_dummy_per_128_padded_tokens",
         f"{AUDIT}::test_padding_sequences_are_sent_their_query_length_as_kv_length"),
    ),
    Mutant(
        "PA workspace not checked at the step's lengths", "ascend_compile/passes/npu_checks.py",
        "            if queries[dtype].paged_attention(shape, host[source], max_blocks, *tensors) > slot:",
        "            if queries[dtype].paged_attention(shape, host[source], max_blocks, *tensors) > slot + (1 << 40):",
        ("tests/test_npu.py::test_a_mixed_batch_needing_more_than_every_uniform_one_is_caught_before_the_kernel",
         "tests/test_npu.py::test_pa_is_asked_once_per_graph_and_each_step_needing_more_runs_eagerly"),
    ),
    Mutant(
        "MLA rope part dropped from the score", "ascend_compile/ops/reference.py",
        "        scores = scores + torch.einsum(", "        scores = scores + 0 * torch.einsum(",
        ("tests/test_mla.py::test_mla_equals_the_dense_oracle",),
    ),
    Mutant(
        "MLA lengths not refreshed", "ascend_compile/passes/select_kernels.py",
        "for name, host in hosts.items())", "for name, host in hosts.items() if kernel != tiling.MLA)",
        ("tests/test_mla.py::test_the_deepseek_example_is_replayed_from_captured_graphs_and_equals_eager",),
    ),
    Mutant(
        "MLA cache write at slot -1", "ascend_compile/ops/mla.py",
        "    valid = slots >= 0\n", "    valid = slots >= -1\n",
        ("tests/test_mla.py::test_the_cache_write_skips_slot_minus_one",),
    ),
    # issue 26 on runtime "npu": MLA through FIA v2's query_rope/key_rope form
    Mutant(
        "FIA v2 MLA lengths not refreshed", "ascend_compile/runtime/npu.py",
        "            return self.kernels.mla_fused_infer_attention\n",
        "            return lambda *a: None if self._update is not None else self.kernels.mla_fused_infer_attention(*a)\n",
        (f"{NPU_MLA}::test_the_deepseek_example_on_npu_is_replayed_from_captured_graphs_and_equals_eager",),
    ),
    Mutant(
        "MLA v2 workspace not passed", "ascend_compile/ops/npu/mla.py",
        "workspace=workspace, out=[out, softmax_lse])", "workspace=None, out=[out, softmax_lse])",
        (f"{NPU_MLA}::test_the_deepseek_example_on_npu_is_replayed_from_captured_graphs_and_equals_eager",),
    ),
    Mutant(
        "MLA decode calls in sparse_mode 3", "ascend_compile/ops/npu/rules.py",
        "    return 3 if max(query_lens, default=0) > 1 else 0\n", "    return 3\n",
        (f"{NPU_MLA}::test_fia_v2_mla_equals_the_reference_with_the_wheels_schemas",),
    ),
    Mutant(
        "mixed MLA graph captured as a decode step", "ascend_compile/passes/padding.py",
        "    return not key.decode or all(", "    return False and all(",
        (f"{NPU_MLA}::test_the_deepseek_example_on_npu_is_replayed_from_captured_graphs_and_equals_eager",),
    ),
    Mutant(
        "MLA query lengths over 16 served by a graph", "ascend_compile/passes/npu_checks.py",
        "            if refusal:\n                return f\"{name}: {refusal}\"\n",
        "            if False:\n                return f\"{name}: {refusal}\"\n",
        (f"{NPU_MLA}::test_a_step_of_more_than_16_query_tokens_per_sequence_is_served_piecewise_saying_why",),
    ),
    Mutant(
        "MLA head-count rule removed", "ascend_compile/ops/npu/rules.py",
        "num_heads in MLA_QUERY_HEADS,", "True,",
        (f"{NPU_MLA}::test_each_documented_constraint_is_refused_at_compile_naming_the_layer",),
    ),
    # issue 26: MLA's Triton kernels (the CUDA path), against the dense oracle in the interpreter
    Mutant(
        "Triton MLA rope part dropped", "ascend_compile/ops/cuda_triton_mla.py",
        "        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=PRECISION) * scale_log2\n",
        "        scores = scores * scale_log2\n",
        (f"{TRITON_MLA}::test_triton_mla_equals_the_dense_oracle",),
    ),
    Mutant(
        "Triton MLA causal mask off by one", "ascend_compile/ops/cuda_triton_mla.py",
        "(key_pos[None, :] <= position[:, None])", "(key_pos[None, :] <= position[:, None] + 1)",
        (f"{TRITON_MLA}::test_triton_mla_equals_the_dense_oracle",),
    ),
    Mutant(
        "Triton MLA head groups ignored", "ascend_compile/ops/cuda_triton_mla.py",
        "            head = head_group * HEAD_ROWS + rows % HEAD_ROWS\n", "            head = rows % HEAD_ROWS\n",
        (f"{TRITON_MLA}::test_triton_mla_head_groups",),
    ),
    Mutant(
        "Triton MLA split records overlap", "ascend_compile/ops/cuda_triton_mla.py",
        "record = (token.to(tl.int64) * num_splits + split) * NUM_HEADS + head",
        "record = (token.to(tl.int64) + split) * NUM_HEADS + head",
        (f"{TRITON_MLA}::test_triton_mla_workspace_holds_the_split_records",),
    ),
    Mutant(
        "MLA dims past Triton tiles allowed", "ascend_compile/targets.py",
        "            if call.meta.kernel == MLA:\n", "            if False:\n",
        ("tests/test_mla.py::test_mla_layers_of_dims_the_triton_tiles_were_not_checked_for_are_refused_on_cuda",),
    ),
    # issue 23: vLLM attention features passed to the op (or refused at compile time where it cannot)
    Mutant(
        "sliding window ignored", "ascend_compile/integrations/vllm/binder.py",
        '{"window": features.window,', '{"window": None,',
        (VLLM_FEATURES + "[sliding window-FLASH_ATTN]",),
    ),
    Mutant(
        "soft-cap dropped in vLLM", "ascend_compile/integrations/vllm/binder.py",
        '"soft_cap": features.soft_cap,', '"soft_cap": None,',
        (VLLM_FEATURES + "[soft-cap-FLASH_ATTN]",),
    ),
    Mutant(
        "sinks dropped in vLLM", "ascend_compile/integrations/vllm/binder.py",
        '"sinks": sinks})', '"sinks": None})',
        (VLLM_FEATURES + "[sinks-ASCEND]",),
    ),
    Mutant(
        "vLLM-Ascend slots converted per step", "ascend_compile/integrations/vllm/metadata.py",
        "lambda ctx: attention_slots(metadata_of(ctx, layer)),", "lambda ctx: attention_slots(metadata_of(ctx, layer)).long(),",
        ("tests/test_vllm.py::test_vllm_ascends_int32_slot_mapping_reaches_the_cache_write_unconverted",),
    ),
    Mutant(
        "vLLM-Ascend host lengths not taken", "ascend_compile/integrations/vllm/metadata.py",
        "        return all(hasattr(metadata, field) for field in cls.FIELDS)", "        return False",
        ("tests/test_vllm.py::test_vllm_ascend_steps_read_no_length_from_the_device",),
    ),
    Mutant(
        "vLLM-Ascend host lengths taken unchecked", "ascend_compile/integrations/vllm/metadata.py",
        "        if problem is None:\n", "        if True:\n",
        ("tests/test_vllm.py::test_stale_vllm_ascend_host_lengths_are_not_used",),
    ),
    Mutant(
        "host copies ignored by the runner", "ascend_compile/lowering/inputs.py",
        "    copy = host_copies.get(spec.name) if host_copies else None\n", "    copy = None\n",
        ("tests/test_vllm.py::test_vllm_ascend_steps_read_no_length_from_the_device",),
    ),
    Mutant(
        "FlashAttention window taken as its left bound", "ascend_compile/integrations/vllm/layers.py",
        "return int(window[0]) + 1", "return int(window[0])",
        (VLLM_FEATURES + "[sliding window-FLASH_ATTN]",),
    ),
    Mutant(
        "other backend not refused", "ascend_compile/integrations/vllm/layers.py",
        '    unsupported = backend_refusal(layer, SUPPORTED_BACKENDS, "attention backend")\n',
        "    unsupported = None\n",
        ("tests/test_vllm.py::test_other_attention_backends_are_refused_by_name_at_compile_time",),
    ),
    Mutant(
        "vLLM graph not traced general", "ascend_compile/integrations/vllm/dynamo_backend.py",
        "        retrace_general(gm, SHARED_TOKEN_SETTINGS)\n",
        "",
        ("tests/test_vllm.py::test_vllms_compile_call_without_dynamic_gives_one_artifact_for_every_step_shape",),
    ),
    Mutant(
        "NPU attention features not refused", "ascend_compile/passes/npu_checks.py",
        "    _check_features(call, keys)\n", "    pass\n",
        (f"{NPU_FEATURES}::test_a_soft_cap_stays_refused_at_compile_naming_the_layer_and_why",),
    ),
    Mutant(
        "latent attention not refused under transformers", "ascend_compile/integrations/transformers.py",
        "    _refuse_latent_attention(model)\n", "",
        ("tests/test_transformers_cb.py::test_deepseek_v3s_latent_attention_is_refused_naming_the_layer_and_head_dims",),
    ),
    # issue 26: vLLM's MLA ops (`integrations/vllm/mla.py`), on vLLM's own DeepSeek-V2 (in the vLLM venv)
    Mutant(
        "MLA prefill context dropped", "ascend_compile/integrations/vllm/mla.py",
        "            lens = lens + context[:n].to(lens.device, non_blocking=True)\n",
        "            pass\n",
        (MLA_REAL,), vllm=True,
    ),
    Mutant(
        "MLA decodes' block table rows only", "ascend_compile/integrations/vllm/mla.py",
        "        parts.append(metadata.prefill.block_table[: metadata.num_prefills])\n",
        "        parts.append(metadata.prefill.block_table[:0] if parts else metadata.prefill.block_table)\n",
        (MLA_REAL,), vllm=True,
    ),
    Mutant(
        "sparse MLA not refused", "ascend_compile/integrations/vllm/mla.py",
        "    if getattr(layer, \"use_sparse\", False) or getattr(layer, \"indexer\", None) is not None:\n",
        "    if False:\n",
        ("tests/test_vllm_mla_real.py::test_a_sparse_mla_layer_is_refused_at_compile_time",), vllm=True,
    ),
    Mutant(
        "the backend check passes every backend", "ascend_compile/integrations/vllm/layers.py",
        "    if path in supported:\n",
        "    if True:\n",
        ("tests/test_vllm.py::test_other_attention_backends_are_refused_by_name_at_compile_time",),
    ),
    Mutant(
        "other MLA backend not refused", "ascend_compile/integrations/vllm/mla.py",
        '    unsupported = backend_refusal(layer, SUPPORTED_MLA_BACKENDS, "MLA attention backend")\n',
        "    unsupported = None\n",
        ("tests/test_vllm_mla_real.py::test_another_mla_backend_is_refused_by_name",), vllm=True,
    ),
    # issue 36: the mutation audit's survivors
    Mutant(
        "a uint8 mask index not a host read", "ascend_compile/runtime/sim/classify.py",
        "i.dtype in (torch.bool, torch.uint8) for i in indices)", "i.dtype == torch.bool for i in indices)",
        ("tests/test_sim.py::test_host_sync_during_capture_is_refused",),
    ),
    Mutant(
        "static inputs kept after an update rebinds", "ascend_compile/runtime/sim/updates.py",
        "        task.rebind(op.args, op.kwargs)\n    handle.recording.static_inputs = None\n",
        "        task.rebind(op.args, op.kwargs)\n",
        ("tests/test_sim.py::test_an_update_moving_a_tensor_operand_moves_the_static_input_the_launch_checks",),
    ),
    Mutant(
        "overlap check needs both inputs staged", "ascend_compile/lowering/inputs.py",
        "(i in copied or j in copied)", "(i in copied and j in copied)",
        (f"{AUDIT36}::test_a_staged_written_input_aliasing_the_kv_cache_runs_eagerly_and_equals_eager",),
    ),
    Mutant(
        "PA step checked against the largest slot", "ascend_compile/passes/npu_checks.py",
        "            slot = call.workspace.meta[WORKSPACE_BYTES_KEY][str(key)]\n",
        "            slot = max(call.workspace.meta[WORKSPACE_BYTES_KEY].values())\n",
        (f"{AUDIT36}::test_each_pa_step_is_checked_against_the_slot_of_its_own_graph",),
    ),
    Mutant(
        "MLA's dummy limit only where every kernel is MLA", "ascend_compile/passes/padding.py",
        "    limit = MLA_PADDING_CHUNK if any(call.meta.kernel == tiling.MLA",
        "    limit = MLA_PADDING_CHUNK if all(call.meta.kernel == tiling.MLA",
        (f"{AUDIT36}::test_a_model_mixing_plain_and_latent_attention_packs_mixed_padding_into_dummies_mla_takes",),
    ),
    Mutant(
        "vLLM block table not cut to num_reqs", "ascend_compile/integrations/vllm/context.py",
        "    return getattr(metadata, field)[: metadata.seq_lens.shape[0]]\n", "    return getattr(metadata, field)\n",
        ("tests/test_vllm.py::test_query_start_loc_longer_than_the_step_is_cut_to_its_sequences",),
    ),
    Mutant(
        "NPU generator not kept", "ascend_compile/runtime/npu.py",
        "        return generators_kept(self.npu, self._device)\n", "        return generators_kept()\n",
        ("tests/test_rng.py::test_seeded_sampling_matches_eager_on_npu_whose_warm_up_runs_the_step",),
    ),
    Mutant(
        "vLLM-Ascend query ends too many accepted", "ascend_compile/integrations/vllm/metadata.py",
        "if len(lens) != seqs or len(ends) != seqs:", "if len(lens) != seqs or len(ends) < seqs:",
        ("tests/test_vllm.py::test_stale_vllm_ascend_host_lengths_are_not_used",),
    ),
    # issue 33
    Mutant(
        "FIA decode graphs serve mixed steps", "ascend_compile/targets.py",
        "frozenset({PA, FIA, MLA})", "frozenset({PA, MLA})",
        ("tests/test_npu.py::test_fia_decode_graphs_are_captured_as_decode_and_mixed_steps_get_their_own_graph",),
    ),
    Mutant(
        "FIA's branch not a task kind", "ascend_compile/runtime/sim/kernels.py",
        'kind += "[S=1]" if one_query_token_each(arg(op, args, kwargs, ends)[1]) else "[S>1]"', 'kind += ""',
        ("tests/test_sim.py::test_an_update_moving_fia_between_its_one_token_and_prompt_branches_is_refused",),
    ),
    Mutant(
        "uncapturable op re-raised", "ascend_compile/lowering/runner.py",
        "        except UncapturableOp as err:\n            self._serve_eagerly(entry, err)\n            return\n", "",
        (UNCAPTURABLE,),
    ),
    Mutant(
        "uncapturable op's graphs tried again", "ascend_compile/lowering/runner.py",
        "        if blocked is not None and entry.eager_reason is None:  # not tried again",
        "        if False:  # not tried again",
        (UNCAPTURABLE,),
    ),
    Mutant(
        "host read in a capture not an uncapturable op", "ascend_compile/lowering/capture.py",
        "        return isinstance(err, HostSync) or (self.warmed_up and not isinstance(err, AscendCompileError))",
        "        return self.warmed_up and not isinstance(err, AscendCompileError)",
        (UNCAPTURABLE,),
    ),
    Mutant(
        "float32 not refused at compile", "ascend_compile/passes/npu_checks.py",
        "    _refuse(call.node, lambda: npu_rules.check_attention_dtype(kernel, query.dtype, key_cache.dtype))\n", "",
        (f"{DEVICE}::test_a_float32_model_is_refused_at_compile_naming_the_layer_and_the_dtype",),
    ),
    Mutant(
        "fake kernels take float32", "tests/fake_torch_npu.py",
        "    if t.dtype not in (torch.float16, torch.bfloat16):",
        "    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):",
        (f"{DEVICE}::test_the_fake_attention_kernels_refuse_float32_citing_their_docs",),
    ),
    Mutant(
        "verify clones caches whole with two slot mappings", "ascend_compile/lowering/verify.py",
        "        if spec.role is Role.KV_CACHE and slots is not None and args[i].dim() >= 2:",
        "        if spec.role is Role.KV_CACHE and len(mappings) == 1 and args[i].dim() >= 2:",
        ("tests/test_verify.py::test_a_step_with_two_slot_mappings_snapshots_only_the_rows_it_writes",),
    ),
    Mutant(
        "verify_every ignored", "ascend_compile/lowering/runner.py",
        "        if self.verify and (entry.verified is None or (every and entry.replays % every == 0)):",
        "        if self.verify and entry.verified is None:",
        ("tests/test_verify.py::test_verify_every_nth_replay_catches_a_fault_that_appears_later",),
    ),
    Mutant(
        "PA's per-step query on stand-ins", "ascend_compile/passes/npu_checks.py",
        "            tensors = [args[i] if i is not None else None for i in inputs]",
        "            tensors = [None, None, None]",
        (f"{DEVICE}::test_each_steps_pa_query_is_asked_with_the_kernels_own_caches_and_block_table",),
    ),
    Mutant(
        "FIA's head rules not refused", "ascend_compile/passes/npu_checks.py",
        "        _refuse(call.node, lambda: npu_rules.check_fia_heads(shape.num_heads, shape.num_kv_heads, shape.head_dim))",
        "        pass",
        (f"{DEVICE}::test_head_limits_are_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "PA's head size not refused", "ascend_compile/passes/npu_checks.py",
        "        _refuse(call.node, lambda: npu_rules.check_pa_head_size(shape.head_dim))\n", "",
        (f"{DEVICE}::test_head_limits_are_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "get_stream_limit unguarded", "ascend_compile/runtime/npu.py",
        "        except (AttributeError, RuntimeError) as err:\n            self._core_limits = False",
        "        except ImportError as err:\n            self._core_limits = False",
        (f"{DEVICE}::test_a_torch_npu_without_core_limits_still_starts_and_serves",),
    ),
    Mutant(
        "fake PA takes a strided out", "tests/fake_torch_npu.py",
        "    _contiguous(\"ATB's AtTensor2AtbTensor: 'at_tensor is not contiguous' (outputs are not copied)\", out=out)\n",
        "",
        (f"{DEVICE}::test_the_fake_pa_copies_strided_inputs_and_refuses_a_strided_out",),
    ),
    Mutant(
        "fake MLA requires a [1] softmax_lse", "tests/fake_torch_npu_mla.py",
        "    attention_out, softmax_lse = out\n",
        "    attention_out, softmax_lse = out\n    _require(softmax_lse.numel() == 1, 'out', 'a [1] softmax_lse', softmax_lse.shape)\n",
        (f"{NPU_MLA}::test_the_fake_takes_a_full_softmax_lse_as_vllm_ascend_passes_it",),
    ),
    # issue 31: direct dispatch's checks the suite was blind to
    Mutant(
        "buffer assignment not counted", "ascend_compile/dispatch/epoch.py",
        "        nn_module.register_module_buffer_registration_hook(_moved)\n",
        "",
        ("tests/test_direct_soundness.py::test_assigned_kv_caches_are_gathered_again",),
    ),
    Mutant(
        "torch function mode check always true", "ascend_compile/dispatch/checks.py",
        "f\"TFN() == {depth} {modes}\"",
        "\"True\"",
        ("tests/test_direct_soundness.py::test_another_torch_function_mode",),
    ),
    Mutant(
        "global module hooks not checked", "ascend_compile/compile_once.py",
        "        if nn_module._has_any_global_hook():\n            return self._eager(args, kwargs)\n",
        "",
        ("tests/test_direct_soundness.py::test_a_global_forward_hook_after_compile",),
    ),
    Mutant(
        "unread object argument not compared", "ascend_compile/dispatch/checks.py",
        "f\"{expr} is C{j}\"",
        "\"True\"",
        ("tests/test_direct_soundness.py::test_a_new_object_argument_the_graph_does_not_read",),
    ),
    # issue 32: vLLM 0.33 beside 0.23 (`integrations/vllm/`); the 0.33-only paths' tests in its venv (`VLLM33_PYTHON`)
    Mutant(
        "vLLM release matched by prefix", "ascend_compile/integrations/vllm/releases.py",
        "    if \".\".join(version.split(\".\")[:2]) not in SUPPORTED:\n",
        "    if not version.startswith(SUPPORTED):\n",
        ("tests/test_vllm.py::test_an_unsupported_vllm_release_is_refused_naming_the_supported_ones",),
    ),
    Mutant(
        "vLLM 0.33 page not transposed", "ascend_compile/integrations/vllm/context.py",
        "        key, value = kv_cache.transpose(1, 2).split(head_size, dim=-1)\n",
        "        key, value = kv_cache.split(head_size, dim=-1)\n",
        ("tests/test_vllm_releases.py",),
    ),
    Mutant(
        "per-request causal taken as causal", "ascend_compile/integrations/vllm/context.py",
        "    if causal is not True:\n",
        "    if causal is None:\n",
        ("tests/test_vllm_releases.py",),
    ),
    Mutant(
        "later steps' metadata not checked", "ascend_compile/integrations/vllm/deferred.py",
        "        if unserved is not None:\n",
        "        if False:\n",
        ("tests/test_vllm_real.py::test_a_step_asking_for_other_than_causal_attention_runs_as_traced_and_says_why_once",),
        vllm=True,
    ),
    Mutant(
        "vLLM 0.33 MLA prefill context dropped", "ascend_compile/integrations/vllm/mla.py",
        "            context = chunked.context_lens if hasattr(chunked, \"context_lens\") else chunked.seq_lens.sum(dim=0)\n",
        "            context = chunked.context_lens * 0 if hasattr(chunked, \"context_lens\") else chunked.seq_lens.sum(dim=0)\n",
        (MLA_REAL,), vllm33=True,
    ),
    # issue 36: failed steps
    Mutant(
        "capture_all at an unpadded step's sizes", "ascend_compile/lowering/runner.py",
        'if self.config.capture_all and self.stats["captures"] == 0 and self.pads_tokens:',
        'if self.config.capture_all and self.stats["captures"] == 0:',
        (FAILED_STEPS + "::test_capture_all_serves_a_one_sequence_mixed_step_and_later_steps[decode-first-pa_max_batch]",),
    ),
    Mutant(
        "capture_all leaves a mixed first step uncaptured", "ascend_compile/lowering/runner.py",
        "        if entry.graph is None and entry.eager_reason is None:  # a mixed step's graph, or no capture_all\n",
        "        elif entry.graph is None:\n",
        (FAILED_STEPS + "::test_capture_all_serves_a_one_sequence_mixed_step_and_later_steps[mixed-first-auto]",),
    ),
    Mutant(
        "a failed step's writes not undone", "ascend_compile/lowering/runner.py",
        "            undo.restore()\n", "",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-save_cache_rows]",
         f"{PIECEWISE}::test_a_piecewise_step_failing_on_a_later_layer_leaves_every_cache_as_before"),
    ),
    Mutant(
        "undo saves the rows of the first slot only", "ascend_compile/lowering/undo.py",
        "args[slot].clamp(0, capacity - 1).long()", "args[slot][:1].clamp(0, capacity - 1).long()",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[eager-save_cache_rows]",),
    ),
    Mutant(
        "undo gathers slots past the cache", "ascend_compile/lowering/undo.py",
        "args[slot].clamp(0, capacity - 1).long()", "args[slot].clamp(min=0).long()",
        (FAILED_STEPS + "::test_a_slot_past_the_cache_is_refused_by_the_cache_write_naming_it[save_cache_rows]",),
    ),
    Mutant(
        "undo skips inputs written whole", "ascend_compile/lowering/undo.py",
        "            whole = [(args[i], args[i].clone()) for i in self.whole if isinstance(args[i], torch.Tensor)]\n",
        "            whole = []\n",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-counted-default]",),
    ),
    # issue 44: torch 2.10's dynamo misses a parameter's requires_grad switched on: the runner checks
    Mutant(
        "grad-mode steps replay without autograd", "ascend_compile/lowering/runner.py",
        '        if torch.is_grad_enabled() and any(getattr(a, "requires_grad", False) for a in args):\n',
        "        if False:\n",
        ("tests/test_direct_soundness.py::test_the_runner_itself_runs_a_step_needing_autograd_as_traced",),
    ),
    # issue 45: a step is its graph (no cache rows saved by default; a failed step names its rows)
    Mutant(
        "every step saves its cache rows", "ascend_compile/lowering/runner.py",
        "undo = self.undo.save(args, self.config.save_cache_rows)", "undo = self.undo.save(args, True)",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-default]",),
    ),
    Mutant(
        "a failed step's note claims its rows were put back", "ascend_compile/lowering/undo.py",
        "        if undo.rows or not self.rows:\n", "        if True:\n",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-default]",
         f"{PIECEWISE}::test_a_piecewise_step_failing_on_a_later_layer_leaves_every_cache_as_before"),
    ),
    Mutant(
        "a failed step's note names only the first slot input's slots", "ascend_compile/lowering/undo.py",
        "        values = sorted({v for _, slot in self.rows for v in args[slot].reshape(-1).tolist() if v >= 0})\n",
        "        values = sorted({v for v in args[self.rows[0][1]].reshape(-1).tolist()[:1] if v >= 0})\n",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-default]",),
    ),
    Mutant(
        "a failed replay keeps its graph", "ascend_compile/lowering/graph_entry.py",
        "            self.graph, self.verified = None, None\n", "",
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[sim-default]",),
    ),
    Mutant(
        "npu waits for a failed step's end", "ascend_compile/runtime/npu.py",
        'must not wait for it."""\n        self._previous_step = self.npu.Event()\n        self._steps = 0\n',
        'must not wait for it."""\n',
        (FAILED_STEPS + "::test_a_step_failing_on_a_later_layer_leaves_every_cache_as_before[npu-default]",),
    ),
    Mutant(
        "a failed capture keeps what its run wrote", "ascend_compile/lowering/graph_entry.py",
        "        finally:  # a capture that raises half-way (an op that cannot be captured) leaves them as they were too\n",
        "        except RuntimeError:\n            raise\n        else:\n",
        (FAILED_STEPS + "::test_a_capture_failing_on_a_later_layer_leaves_the_inputs_it_wrote_as_before[sim]",),
    ),
    Mutant(
        "vLLM's retrace of a recompile splits ids and positions", "ascend_compile/compile_once.py",
        '    (torch._dynamo.config, "automatic_dynamic_shapes", False),\n', "",
        ("tests/test_vllm.py::test_dynamic_batch_3_then_batch_1_with_a_rotary_view_equals_eager",),
    ),
    Mutant(
        "vLLM has_sink without impl.sinks served plain", "ascend_compile/integrations/vllm/layers.py",
        'getattr(layer, "has_sink", False)', 'getattr(layer, "has_sinks", False)',
        ("tests/test_vllm_real.py::test_a_layer_built_with_sinks_its_impl_does_not_hold_is_refused_at_compile_time",),
        vllm=True,
    ),
    # issue 33 item 7: windows and sinks on runtime "npu" as vLLM-Ascend binds them (`ops/npu/features.py`)
    Mutant(
        "npu window off by one (vLLM-Ascend's pre_tokens=W whatever the probe)", "ascend_compile/ops/npu/band_probe.py",
        "    return None if edge is None else int(window) - edge\n", "    return int(window)\n",
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode"
         f"[docs-band-ignored-at-s1]",),
    ),
    # the band's edge: the docs' pre_tokens = W - 1 or vLLM-Ascend's W, decided by the device's edge probe
    Mutant(
        "pre_tokens fixed at W-1 whatever the probe", "ascend_compile/ops/npu/band_probe.py",
        "    return None if edge is None else int(window) - edge\n", "    return int(window) - 1\n",
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode"
         f"[vllm-edge-band-applied-at-s1]",
         f"{NPU_FEATURES}::test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager[vllm-edge-band-applied-at-s1]"),
    ),
    Mutant(
        "the band edge probe's answer of neither reading not refused", "ascend_compile/targets.py",
        "            if why:\n                return f\"{key}: not captured", "            if False:\n                return f\"{key}: not captured",
        (f"{NPU_BAND_EDGE}::test_windowed_layers_run_eagerly_where_the_edge_probe_finds_neither_reading",),
    ),
    Mutant(
        "the binding's edge backstop dropped", "ascend_compile/ops/npu/kernels.py",
        "        if window is not None and pre_tokens is None:", "        if False:",
        (f"{NPU_BAND_EDGE}::test_windowed_layers_run_eagerly_where_the_edge_probe_finds_neither_reading",),
    ),
    Mutant(
        "npu window sent in causal mode", "ascend_compile/ops/npu/kernels.py",
        '        "sparse_mode": npu_features.sparse_mode(pre_tokens),\n',
        '        "sparse_mode": npu_features.sparse_mode(None),\n',
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode",),
    ),
    Mutant(
        "npu sinks' window sent in causal mode", "ascend_compile/ops/npu/features.py",
        '        "sparse_mode": sparse_mode(pre_tokens),\n', '        "sparse_mode": CAUSAL_SPARSE_MODE,\n',
        (f"{NPU_FEATURES}::test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager",),
    ),
    Mutant(
        "npu sinks dropped (FIA v1 without learnable_sink)", "ascend_compile/ops/npu/kernels.py",
        "        if sinks is not None:\n            npu_features.sinks_attention(",
        "        if False:\n            npu_features.sinks_attention(",
        (f"{NPU_FEATURES}::test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager",),
    ),
    Mutant(
        "npu learnable_sink rules not refused at compile", "ascend_compile/passes/npu_checks.py",
        "        _refuse(call.node, lambda: npu_rules.check_sinks(",
        "        (lambda: npu_rules.check_sinks(",
        (f"{NPU_FEATURES}::test_sinks_fia_v2_does_not_take_are_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "FIA's workspace asked without the layer's window and sinks", "ascend_compile/ops/npu/workspace_queries.py",
        "                                             window=features.window, sinks=sinks)",
        "                                             window=None, sinks=None)",
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode",
         f"{NPU_FEATURES}::test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager"),
    ),
    Mutant(
        "fake band's pre_tokens counts the query's own key", "tests/fake_torch_npu_features.py",
        'BAND_READINGS = {"docs": 1,', 'BAND_READINGS = {"docs": 0,',
        (f"{NPU_FEATURES}::test_the_fake_follows_the_docs_at_one_query_token_per_sequence_unless_told_otherwise",
         f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode"
         f"[docs-band-ignored-at-s1]"),
    ),
    Mutant(
        "fake band's constraints unchecked", "tests/fake_torch_npu_features.py",
        "        _require(pre >= -q and nxt >= -kv and pre + nxt >= 0,", "        _require(True,",
        (f"{NPU_FEATURES}::test_the_fake_refuses_band_and_sink_calls_its_docs_forbid",),
    ),
    # the band at one query token per sequence: the docs say it has no effect (L8110), vLLM-Ascend relies on
    # it; the device's probe decides (`ops/npu/band_probe.py`)
    Mutant(
        "the S=1 band probe assumed true", "ascend_compile/ops/npu/band_probe.py",
        "        answers[key] = _probe(kernels, form)\n", "        answers[key] = True\n",
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode"
         f"[docs-band-ignored-at-s1]",
         f"{NPU_FEATURES}::test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager[docs-band-ignored-at-s1]"),
    ),
    Mutant(
        "the S=1 band probe's answer not guarded per step", "ascend_compile/passes/npu_checks.py",
        "              window_guard(gm, band_at_single_query) if band_at_single_query else None]",
        "              None]",
        (f"{NPU_FEATURES}::test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode"
         f"[docs-band-ignored-at-s1]",),
    ),
    Mutant(
        "the binding's S=1 band backstop dropped", "ascend_compile/ops/npu/kernels.py",
        "                not self.band_at_single_query(form):",
        "                not self.band_at_single_query(form) and False:",
        (f"{NPU_FEATURES}::test_the_binding_refuses_a_windowed_decode_call_past_the_window_the_device_would_not_band",),
    ),
    Mutant(
        "fake applies the band at S=1 against its docs", "tests/fake_torch_npu_features.py",
        "        return None  # \"Q_S为1时该参数无效\"", "        pass  # \"Q_S为1时该参数无效\"",
        (f"{NPU_FEATURES}::test_the_fake_follows_the_docs_at_one_query_token_per_sequence_unless_told_otherwise",),
    ),
    Mutant(
        "the pool estimate keeps every temporary of a graph", "ascend_compile/passes/memory_estimate.py",
        "                if key not in holds[node]:\n                    events.append((\"free\", ids[key], None))",
        "                if False:\n                    events.append((\"free\", ids[key], None))",
        (f"{VLLM_REAL}::test_the_estimate_made_at_the_profile_run_bounds_the_graph_memory_capture_all_takes",),
        vllm=True,
    ),
    Mutant(
        "the estimate leaves the mixed graphs out", "ascend_compile/integrations/vllm/memory.py",
        "        keys = sorted(rewritten.choices, key=lambda k: (not k.decode, -k.bucket))  # capture order",
        "        keys = sorted((k for k in rewritten.choices if k.decode), key=lambda k: -k.bucket)",
        (f"{VLLM_REAL}::test_the_estimate_made_at_the_profile_run_bounds_the_graph_memory_capture_all_takes",),
        vllm=True,
    ),
    Mutant(
        "the KV budget not told to vLLM's suggestion and startup plan", "ascend_compile/integrations/vllm/kv_budget.py",
        "        worker.peak_activation_memory += nbytes", "        pass",
        (f"{VLLM_REAL}::test_the_worker_sizes_the_kv_cache_with_our_graph_memory_taken_out",),
        vllm33=True,
    ),
    Mutant(
        "a user-set KV cache size reduced anyway", "ascend_compile/integrations/vllm/kv_budget.py",
        "    if user_set:\n", "    if False:\n",
        (f"{VLLM_REAL}::test_a_user_set_kv_cache_size_an_override_and_too_little_memory",),
        vllm=True,
    ),
    Mutant(
        "an empty task operand kept as the tensor (its block pinned)", "ascend_compile/runtime/sim/memory.py",
        "        if x.numel() == 0 and is_cpu_dense(x):", "        if False:",
        ("tests/test_sim.py::test_an_empty_operand_of_a_recorded_task_does_not_keep_its_storages_block",),
    ),
    Mutant(
        "the pool model keeps each capture's outputs", "ascend_compile/passes/memory_estimate.py",
        "            model.release(handle)\n    return model.reserved_bytes()", "            pass\n    return model.reserved_bytes()",
        ("tests/test_memory_estimate.py::test_the_traced_pool_is_what_the_simulators_captures_reserve",),
    ),
    Mutant(
        "the planning context gives each layer its own slot mapping", "ascend_compile/integrations/vllm/planning_context.py",
        "            metadata[name], slots[name] = groups[spec]",
        "            metadata[name], slots[name] = groups[spec][0], fake((1,), torch.int64)",
        (f"{VLLM_REAL}::test_the_estimate_made_at_the_profile_run_bounds_the_graph_memory_capture_all_takes",),
        vllm=True,
    ),
    Mutant(
        "piecewise: the eager nodes run before the piece they read has run", "ascend_compile/lowering/piecewise.py",
        "                runtime.after_piece()  # what the host issues next (the eager nodes) reads its results",
        "                pass",
        (f"{PIECEWISE}::test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise",),
    ),
    Mutant(
        "piecewise: the simulator runs nothing of the stream before the eager nodes", "ascend_compile/runtime/sim/runtime.py",
        "        run that stream first (`run_stream`).\"\"\"\n        self.run_stream()\n",
        "        run that stream first (`run_stream`).\"\"\"\n",
        (f"{PIECEWISE}::test_an_uncapturable_op_is_run_between_pieces_and_every_step_equals_eager",),
    ),
    Mutant(
        "piecewise: a synchronize after every piece", "ascend_compile/runtime/base.py",
        "        The simulator, which runs eager ops on the host as they are issued, runs the stream first.\"\"\"\n",
        "        The simulator, which runs eager ops on the host as they are issued, runs the stream first.\"\"\"\n"
        "        self.synchronize()\n",
        (f"{PIECEWISE}::test_an_uncapturable_op_is_run_between_pieces_and_every_step_equals_eager",),
    ),
    Mutant(
        "npu: a piecewise step's held host tensors never let go", "ascend_compile/runtime/npu.py",
        "        self._held = [(event, held) for event, held in self._held if not event.query()]\n",
        "",
        ("tests/test_npu.py::test_a_piecewise_steps_host_tensors_are_held_until_the_stream_passes_its_end",),
    ),
    Mutant(
        "update table: a task not re-issued is not released either (its event unrecorded)",
        "ascend_compile/lowering/capture.py",
        "                count += 1\n            if entry.event is not None:\n                entry.event.record()\n",
        "                count += 1\n                if entry.event is not None:\n                    entry.event.record()\n",
        ("tests/test_backend.py::test_a_task_whose_host_lists_did_not_change_since_the_last_replay_is_not_issued_again",),
    ),
    Mutant(
        "update table: no task re-issued after the first replay, changed lengths or not",
        "ascend_compile/lowering/capture.py",
        "            if not persist or not entry.sources.isdisjoint(changed):\n",
        "            if not persist:\n",
        ("tests/test_backend.py::test_a_task_whose_host_lists_did_not_change_since_the_last_replay_is_not_issued_again",),
    ),
    Mutant(
        "direct: the parameters' identity taken as checked for any route", "ascend_compile/lowering/input_checks.py",
        "        verified = fixed is not None and fixed is self._verified\n",
        "        verified = fixed is not None\n",
        ("tests/test_direct_soundness.py::test_two_models_of_one_class_sharing_submodules",),
    ),
    Mutant(
        "direct: a route's identity check remembered for a route holding only some of the objects",
        "ascend_compile/lowering/input_checks.py",
        "        elif fixed is not None and self._identified <= fixed:\n",
        "        elif fixed is not None:\n",
        ("tests/test_direct_soundness.py::test_a_parameter_passed_as_an_argument_under_frozen_parameters",),
    ),
    Mutant(
        "direct: a module's class not compared", "ascend_compile/dispatch/checks.py",
        '"list(map(type, MT)) == MC", True))\n',
        '"True", True))\n',
        ("tests/test_direct_soundness.py::test_a_submodule_whose_class_is_changed",),
    ),
    Mutant(
        "direct: addresses read from the kept tensors though one is the call's", "ascend_compile/lowering/input_checks.py",
        "            self._held = tuple(pick(args)) if not moved and self.addresses.keys() <= fixed else None\n",
        "            self._held = tuple(pick(args)) if not moved else None\n",
        ("tests/test_direct_soundness.py::test_kv_caches_passed_by_the_caller_swapped_under_frozen_parameters",),
    ),
    Mutant(
        "piecewise live capture draws from the step's generator", "ascend_compile/lowering/piecewise.py",
        "        with runtime.generators_kept():  # the live run's replays and eager nodes draw nothing of the step's\n",
        "        if True:\n",
        ("tests/test_rng.py::test_seeded_sampling_matches_eager_on_steps_served_by_pieces",),
    ),
    Mutant(
        "a replay's phases left in the step's host time", "ascend_compile/lowering/phase_seconds.py",
        "        self.device += end - start\n",
        "        pass\n",
        ("tests/test_backend.py::test_a_steps_seconds_split_into_its_phases_and_the_host",),
    ),
    Mutant(
        "direct: a list argument's length not checked", "ascend_compile/dispatch/checks.py",
        '            expr_check += f" and len({expr}) == {len(value)}"\n',
        "            pass\n",
        ("tests/test_direct_soundness.py::test_a_list_and_a_dict_argument_of_another_length_or_keys",),
    ),
    Mutant(
        "direct: a dict argument's keys not checked", "ascend_compile/dispatch/checks.py",
        '            expr_check += f" and list({expr}) == RK{j}"\n',
        "            pass\n",
        ("tests/test_direct_soundness.py::test_a_list_and_a_dict_argument_of_another_length_or_keys",),
    ),
    Mutant(
        "direct: a constant argument compared by value only", "ascend_compile/dispatch/checks.py",
        '                                f"type({expr}) is Y{j} and {expr} == C{j}"))\n',
        '                                f"{expr} == C{j}"))\n',
        ("tests/test_direct_soundness.py::test_a_constant_equal_in_value_but_of_another_type",),
    ),
    Mutant(
        "verify: slot 0 left out of the step's cache rows", "ascend_compile/lowering/verify.py",
        "    slots = torch.cat([m[m >= 0].long().flatten() for m in mappings]).unique() if mappings else None\n",
        "    slots = torch.cat([m[m > 0].long().flatten() for m in mappings]).unique() if mappings else None\n",
        ("tests/test_verify.py::test_a_replay_wrong_only_at_slot_0_is_caught",),
    ),
    Mutant(
        "failed steps: a KeyboardInterrupt mid-step skips putting back what the step wrote",
        "ascend_compile/lowering/runner.py",
        "        except BaseException as err:\n            undo.restore()\n",
        "        except Exception as err:\n            undo.restore()\n",
        ("tests/test_failed_steps.py::test_a_step_interrupted_mid_graph_with_a_cache_a_plain_op_writes_too",),
    ),
    Mutant(
        "a host scalar's value not checked before a replay", "ascend_compile/lowering/input_checks.py",
        "        if values and list(map(torch.Tensor.item, pick_scalars(args))) != values:\n",
        "        if False:\n",
        ("tests/test_piecewise.py::test_a_host_scalar_changing_between_piecewise_steps_and_three_outputs",),
    ),
    Mutant(
        "piecewise: a graph that failed verify keeps serving", "ascend_compile/lowering/piecewise_serve.py",
        '        if not graph.verified["ok"]:\n',
        "        if False:\n",
        ("tests/test_piecewise.py::test_a_piecewise_graph_that_fails_verify_serves_no_step",),
    ),
    Mutant(
        "vLLM: a layer's cache views kept after its storage moved in place", "ascend_compile/integrations/vllm/context.py",
        "        if cache is not self._cache or cache.data_ptr() != self._address or cache.shape != self._shape:\n",
        "        if cache is not self._cache or cache.shape != self._shape:\n",
        (f"{VLLM_REAL}::test_a_layers_cache_storage_moved_in_place_is_bound_anew",),
        vllm=True,
    ),
    Mutant(
        "piecewise: a value only the graph's output reads released after the last piece", "ascend_compile/lowering/piecewise.py",
        "        for a in self.output.all_input_nodes:\n            readers[a] = len(self.segments)\n",
        "",
        (f"{PIECEWISE}::test_a_host_scalar_changing_between_piecewise_steps_and_three_outputs",),
    ),
    Mutant(
        "vLLM: the model's own tensors left symbolic in the general retrace (LoRA at one token)",
        "ascend_compile/integrations/vllm/dynamo_backend.py",
        "        model_state_static(gm, example_inputs)\n",
        "",
        ("tests/test_vllm_lora.py",),
        vllm=True,
    ),
    Mutant(
        "roles: a model-held tensor with a symbolic size taken for batch data (padded)", "ascend_compile/passes/roles.py",
        "        return Role.STATIC if model_state else Role.BATCH\n",
        "        return Role.BATCH\n",
        ("tests/test_vllm_lora.py::test_a_held_tensor_traced_with_the_token_count_is_never_padded",),
        vllm=True,
    ),
    Mutant(
        "piecewise: eager results not copied into the pieces' buffers", "ascend_compile/lowering/piecewise.py",
        "                if targets:", "                if False:",
        (f"{PIECEWISE}::test_an_uncapturable_op_is_run_between_pieces_and_every_step_equals_eager",),
    ),
    Mutant(
        "piecewise: a write into a caller's buffer captured in a piece", "ascend_compile/passes/split_pieces.py",
        '            return Why(f"writes graph input storage ({written.name})", writes_caller=True)', "            pass",
        ("tests/test_runtime_graphs.py::test_writes_that_overlap_only_when_padded_run_eagerly",
         f"{PIECEWISE}::test_a_piecewise_step_failing_on_a_later_layer_leaves_every_cache_as_before"),
    ),
    Mutant(
        "piecewise: sequence-sized nodes kept in pieces", "ascend_compile/lowering/piecewise.py",
        '        token_symbols = set(getattr(tokens, "free_symbols", ())) | set(signature.specialized)',
        "        token_symbols = {s for s in padded if padded[s] == key.bucket} | set(signature.specialized)",
        ("tests/test_audit_survivors.py::test_random_steps_with_empty_and_chunked_sequences_equal_eager",),
    ),
    Mutant(
        "piecewise: eager nodes given the padded rows", "ascend_compile/lowering/piecewise.py",
        "        return value[tuple(slice(0, n) for n in real)]", "        return value",
        (f"{PIECEWISE}::test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise",),
    ),
    Mutant(
        "piecewise: the kernel run where the target refuses its lengths", "ascend_compile/lowering/piecewise.py",
        "            self.refusals[refusal] += 1\n        return plan, False, None",
        "            self.refusals[refusal] += 1\n        return plan, True, None",
        (f"{PIECEWISE}::test_mla_prefill_chunks_on_npu_are_served_piecewise",),
    ),
    Mutant(
        "piecewise: the slot mapping's padding rows left stale", "ascend_compile/lowering/piecewise.py",
        "                    torch._foreach_copy_(targets + [d for d, _ in padding],\n"
        "                                         [value(node) for node, _ in captured.copied] + [c for _, c in padding])",
        "                    torch._foreach_copy_(targets, [value(node) for node, _ in captured.copied])",
        (f"{PIECEWISE}::test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise",),
    ),
    Mutant(
        "piecewise: every static output kept", "ascend_compile/lowering/piecewise.py",
        "            if isinstance(value, torch.Tensor) and last_use.get(node, -1) < before and i not in captured.released:",
        "            if False:",
        (f"{PIECEWISE}::test_the_split_runs_only_the_attention_kernels_eagerly_and_pads_the_slot_mapping_with_minus_one",),
    ),
    Mutant(
        "piecewise: an output released before its last reader is captured", "ascend_compile/lowering/piecewise.py",
        "                self._release(runtime, last_use, index)\n", "                self._release(runtime, last_use, index + 2)\n",
        (f"{PIECEWISE}::test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise",
         f"{PIECEWISE}::test_an_uncapturable_op_is_run_between_pieces_and_every_step_equals_eager"),
    ),
    Mutant(
        "piecewise: moved inputs not seen", "ascend_compile/lowering/piecewise_serve.py",
        "graph.captured_inputs is not None and art.moved(graph, args, step, direct):",
        "graph.captured_inputs is not None and False:",
        (f"{PIECEWISE}::test_a_new_kv_cache_captures_the_pieces_again",),
    ),
    Mutant(
        "piecewise: a node hoisted above the eager write it reads", "ascend_compile/passes/split_pieces.py",
        "            if storages & reads:", "            if False:",
        (f"{PIECEWISE}::test_the_split_runs_only_the_attention_kernels_eagerly_and_pads_the_slot_mapping_with_minus_one",
         f"{PIECEWISE}::test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise"),
    ),
    Mutant(
        "piecewise: the slot not sized for the pieces' kernels", "ascend_compile/passes/pipeline.py",
        "    planned = {**choices, **{key: () for key in pieces}}", "    planned = {**choices, **{key: () for key in pieces[:1]}}",
        (f"{PIECEWISE}::test_the_workspace_slot_is_sized_for_every_piecewise_size_too",),
    ),
    Mutant(
        "the estimate's workspace nodes counted in the pool", "ascend_compile/passes/memory_estimate.py",
        "        if func is self.workspace:", "        if False:",
        ("tests/test_vllm_mla_real.py::test_the_graph_memory_estimate_bounds_what_the_mla_captures_take",),
        vllm=True,
    ),
    Mutant(
        "piecewise: verify_every not applied to pieces", "ascend_compile/lowering/piecewise_serve.py",
        "(graph.verified is None or (every and graph.replays % every == 0))", "graph.verified is None",
        ("tests/test_verify.py::test_verify_every_checks_piecewise_steps_too",),
    ),
    Mutant(
        "verify's tolerance not grown with depth", "ascend_compile/lowering/verify.py",
        "    scale = max(1, layers) ** 0.5\n", "    scale = 1\n",
        ("tests/test_verify.py::test_the_tolerance_passes_a_deep_bf16_model_rounded_otherwise_and_catches_stale_lengths",),
    ),
    Mutant(
        "speculative example: a proposal fed at its predecessor's position", "examples/speculative.py",
        "(r, len(r.tokens) - 1 + j, [p[-1]])", "(r, len(r.tokens) - 2 + j, [p[-1]])",
        ("tests/test_speculative.py::test_speculative_decoding_is_token_equal_to_greedy_and_the_drafter_replays_its_graphs[4]",),
    ),
    Mutant(
        "the graph key remembered per bucket, not per step kind", "ascend_compile/passes/pipeline.py",
        "        key = self._keys.get((bucket, decode))\n        if key is None:\n            key = GraphKey(bucket, decode)\n"
        "            key = self._keys[bucket, decode] = ",
        "        key = self._keys.get((bucket, True))\n        if key is None:\n            key = GraphKey(bucket, decode)\n"
        "            key = self._keys[bucket, True] = ",
        ("tests/test_backend.py::test_decode_and_mixed_steps_of_one_bucket_each_replay_their_own_graph",),
    ),
    Mutant(
        "step sizes remembered by their first size only", "ascend_compile/passes/roles.py",
        "        seen = self._sizes_seen.get(values)\n        if seen is None:\n            symbols = {sym: value for (sym, _, _), value in zip(self._readers, values)}\n",
        "        seen = self._sizes_seen.get(values[:1])\n        if seen is None:\n            symbols = {sym: value for (sym, _, _), value in zip(self._readers, values)}\n"
        "            values = values[:1]\n",
        (BUCKETS,),
    ),
    # issue 48: a capture the device refuses costs one graph
    Mutant(
        "a capture the device refuses fails the step", "ascend_compile/lowering/capture_failures.py",
        "        if device_error(err) or isinstance(err, NotTried):\n            return err\n", "",
        (f"{CAPTURE_FAILURES}::test_a_bucket_and_a_piece_size_the_device_refuses_are_served_otherwise_and_the_rest_captured",),
    ),
    Mutant(
        "a piece size the device refuses keeps serving on its pieces", "ascend_compile/lowering/piecewise_serve.py",
        "            why = art.failures.settle(graph.name, gm, failure)\n",
        "            why = art.failures.settle(graph.name, gm, failure) and None\n",
        (f"{CAPTURE_FAILURES}::test_a_bucket_and_a_piece_size_the_device_refuses_are_served_otherwise_and_the_rest_captured",),
    ),
    Mutant(
        "ranks decide a failed capture each on its own", "ascend_compile/lowering/capture_failures.py",
        "        outcome = agreed_failure(outcome, groups, self.device) if groups else outcome\n", "",
        ("tests/test_tensor_parallel.py::test_a_capture_refused_on_one_rank_is_given_up_on_every_rank",),
    ),
    Mutant(
        "the simulator runs a collective at its capture", "ascend_compile/runtime/sim/launch.py",
        "        if capturing and completes_at_wait(op):\n", "        if False:\n",
        ("tests/test_tensor_parallel.py::test_a_capture_refused_on_one_rank_is_given_up_on_every_rank",),
    ),
    Mutant(
        "the simulator's stream budget not enforced", "ascend_compile/runtime/sim/faults.py",
        "        if self.budget is not None and self.held >= self.budget:\n", "        if False:\n",
        (f"{CAPTURE_FAILURES}::test_a_budget_of_streams_spent_costs_the_graphs_past_it_not_the_steps",),
    ),
    Mutant(
        "a freed graph keeps its stream", "ascend_compile/runtime/sim/faults.py",
        "        weakref.finalize(graph, self.release)\n", "",
        (f"{CAPTURE_FAILURES}::test_a_graph_freed_gives_its_stream_back",),
    ),
    Mutant(
        "a device out of memory inside a capture taken for an uncapturable op", "ascend_compile/lowering/capture.py",
        " is not n.target or device_resource_error(err):", " is not n.target:",
        (f"{CAPTURE_FAILURES}::test_on_npu_a_capture_refused_costs_that_graph",),
    ),
    # issue 48: the graph budget and the start-up ledger
    Mutant(
        "the graph budget ignored", "ascend_compile/lowering/budget.py",
        "    if budget is not None and pieces and full + pieces * len(sizes) > budget:\n", "    if False:\n",
        (f"{GRAPH_BUDGET}::test_a_stream_limit_of_2048_at_80_layers_compiles_and_serves_every_step_equal_to_eager",),
    ),
    Mutant(
        "the piecewise sizes kept are the smallest", "ascend_compile/lowering/budget.py",
        "    return sorted({sizes[round(i * step)] for i in range(keep)})\n", "    return sizes[:keep]\n",
        (f"{GRAPH_BUDGET}::test_a_stream_limit_of_2048_at_80_layers_compiles_and_serves_every_step_equal_to_eager",),
    ),
    Mutant(
        "a piecewise size counted as one graph", "ascend_compile/lowering/budget.py",
        "    return sum(isinstance(s, Piece) for s in graph.segments)\n", "    return 1\n",
        (f"{GRAPH_BUDGET}::test_a_stream_limit_of_2048_at_80_layers_compiles_and_serves_every_step_equal_to_eager",),
    ),
    Mutant(
        "a phase timed inside another counted in both", "ascend_compile/ledger.py",
        "        add(name, total - inner)\n", "        add(name, total)\n",
        (f"{GRAPH_BUDGET}::test_a_phase_timed_inside_another_is_taken_out_of_it",),
    ),
    Mutant(
        "dynamo's trace not timed after a dynamo reset", "ascend_compile/backend.py",
        "    ledger.DynamoClock.install()  # before dynamo's first frame for this backend\n", "",
        (f"{GRAPH_BUDGET}::test_plan_json_and_inspect_give_the_graph_count_the_budget_and_the_start_up_ledger",),
    ),
    Mutant(
        "kernel timing not in the ledger", "ascend_compile/ops/timing.py",
        "@ledger.timed(\"kernel_timing\")\n", "",
        (f"{GRAPH_BUDGET}::test_plan_json_and_inspect_give_the_graph_count_the_budget_and_the_start_up_ledger",),
    ),
    Mutant(
        "inspect says nothing of start-up", "ascend_compile/cli.py",
        "    out.extend(_render_startup(plan))\n", "",
        (f"{GRAPH_BUDGET}::test_plan_json_and_inspect_give_the_graph_count_the_budget_and_the_start_up_ledger",),
    ),
    # issue 48: a warm start repeats nothing deterministic
    Mutant(
        "a warm start asks every question again", "ascend_compile/plan_cache.py",
        "            if asked in answers:\n", "            if False:\n",
        (f"{WARM_START}::test_a_warm_start_times_no_kernel_and_chooses_the_same_kernels",),
    ),
    Mutant(
        "the plan's key without the rank", "ascend_compile/plan_cache.py",
        "            \"device\": device_name(device), \"rank\": rank}", "            \"device\": device_name(device)}",
        (f"{WARM_START}::test_any_part_of_the_key_changed_means_the_plan_is_asked_anew[rank]",),
    ),
    Mutant(
        "the plan's key without the device's name", "ascend_compile/plan_cache.py",
        "            \"device\": device_name(device), \"rank\": rank}", "            \"device\": str(device), \"rank\": rank}",
        (f"{WARM_START}::test_any_part_of_the_key_changed_means_the_plan_is_asked_anew[device]",),
    ),
    Mutant(
        "workspace queries not kept in the plan", "ascend_compile/passes/probe.py",
        "    @plan_cache.remembered(\"workspace_queries\", question=lambda self, key, query: key)\n", "",
        (f"{WARM_START}::test_on_npu_a_warm_start_asks_no_workspace_query",),
    ),
    # issue 47: the FIA kernel's own rules
    Mutant(
        "FIA's 4096-entry rule not refused at compile", "ascend_compile/passes/npu_checks.py",
        "            _refuse(call.node, lambda: npu_rules.check_tnd_sequences(key.bucket))\n", "            pass\n",
        (f"{KERNEL_RULES}::test_a_fia_graph_above_4096_tokens_is_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "FIA probes for a graph above 4096 tokens", "ascend_compile/ops/npu/workspace_queries.py",
        "        npu_rules.check_tnd_sequences(tokens)  #", "        #",
        (f"{KERNEL_RULES}::test_the_fia_probe_sends_only_non_empty_sequences_and_refuses_a_graph_above_4096",),
    ),
    Mutant(
        "FIA probes with empty sequences", "ascend_compile/ops/npu/workspace_queries.py",
        "    query_lens = [kv_capacity] * full + ([rest] if rest else [])\n",
        "    query_lens = [kv_capacity] * full + ([rest] if rest else [])\n"
        "    query_lens += [0] * (tokens - len(query_lens))\n",
        (f"{KERNEL_RULES}::test_the_fia_probe_sends_only_non_empty_sequences_and_refuses_a_graph_above_4096",),
    ),
    Mutant(
        "the device's RuntimeError not caught for piecewise sizes", "ascend_compile/passes/pipeline.py",
        "        except (ValueError, RuntimeError) as err:", "        except ValueError as err:",
        (f"{KERNEL_RULES}::test_a_piecewise_size_of_8192_compiles_on_the_devices_runtime_error_path",),
    ),
    Mutant(
        "the fake's 4096-entry rule a ValueError", "tests/fake_torch_npu.py",
        "    raise RuntimeError(f\"EZ9999: fake aclnn:", "    raise ValueError(f\"EZ9999: fake aclnn:",
        (f"{KERNEL_RULES}::test_a_tnd_call_of_more_than_4096_entries_is_the_devices_runtime_error",),
    ),
    Mutant(
        "FIA's block table narrowed to each step's batch", "ascend_compile/ops/npu/kernels.py",
        "        ends, kv_lens = table_batch(block_table, actual_seq_lengths, actual_seq_lengths_kv)\n",
        "        block_table = validate.sequence_rows(block_table, len(actual_seq_lengths_kv))\n"
        "        ends, kv_lens = list(actual_seq_lengths), list(actual_seq_lengths_kv)\n",
        (f"{KERNEL_RULES}::test_every_fia_update_keeps_the_captured_batch_and_block_table",),
    ),
    Mutant(
        "FIA's TND head dim bound the docs' 512", "ascend_compile/ops/npu/rules.py",
        "FIA_MAX_HEAD_DIM = 256\n", "FIA_MAX_HEAD_DIM = 512\n",
        (f"{DEVICE}::test_head_limits_are_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "a layer form the device refuses not refused at compile", "ascend_compile/passes/npu_checks.py",
        "        if why:\n            why = f\"{layer_of(call.node)}: {kernel} does not take",
        "        if False:\n            why = f\"{layer_of(call.node)}: {kernel} does not take",
        (f"{KERNEL_RULES}::test_a_layer_form_the_devices_kernel_refuses_is_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "the form probe asks only a mixed call", "ascend_compile/ops/npu/form_probe.py",
        "    for tokens in (1, 2):", "    for tokens in (2,):",
        (f"{KERNEL_RULES}::test_the_form_probe_asks_once_per_distinct_form",),
    ),
    Mutant(
        "the form probe's answers not kept", "ascend_compile/ops/npu/form_probe.py",
        "    if key not in answers:", "    if True:",
        (f"{KERNEL_RULES}::test_the_form_probe_asks_once_per_distinct_form",),
    ),
    Mutant(
        "the fake's PFA path takes float16", "tests/fake_torch_npu_sources.py",
        "    if dtype != torch.bfloat16:", "    if False:",
        (f"{KERNEL_RULES}::test_a_layer_form_the_devices_kernel_refuses_is_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "the fake's later source without its SplitFuse path", "tests/fake_torch_npu_sources.py",
        "    return source == LATER and not sinks", "    return False and not sinks",
        (f"{KERNEL_RULES}::test_a_layer_form_the_devices_kernel_refuses_is_refused_at_compile_naming_the_layer",),
    ),
    Mutant(
        "auto's timing fails the compile on a form the device refuses", "ascend_compile/ops/npu/kernels.py",
        "    except RuntimeError as err:  # the device's kernel refuses this form",
        "    except ValueError as err:  # the device's kernel refuses this form",
        (f"{KERNEL_RULES}::test_auto_times_a_refused_form_as_never_finishing_and_refuses_the_layer_by_name",),
    ),
    Mutant(
        "the fake lets an update grow FIA's batch", "tests/fake_torch_npu_batches.py",
        "            if call[0] > entries:", "            if False:",
        (f"{KERNEL_RULES}::test_the_fake_refuses_an_update_growing_the_batch_or_rebinding_the_block_table",),
    ),
    Mutant(
        "the fake lets an update rebind the block table", "tests/fake_torch_npu_batches.py",
        "            if call[1] != table:", "            if False:",
        (f"{KERNEL_RULES}::test_the_fake_refuses_an_update_growing_the_batch_or_rebinding_the_block_table",),
    ),
    # issue 47: a layer form the device refuses, served eagerly on request (refused_layers="eager")
    Mutant(
        "refused_layers 'eager' still refuses the layer", "ascend_compile/passes/npu_checks.py",
        "            if not eager_refused:\n", "            if True:\n",
        (f"{KERNEL_RULES}::test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning",),
    ),
    Mutant(
        "a layer served eagerly kept on its kernel in the full graphs", "ascend_compile/passes/pipeline.py",
        "            select_kernels(variant.gm, variant.kernels, eager_layers)\n",
        "            select_kernels(variant.gm, variant.kernels)\n",
        (f"{KERNEL_RULES}::test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning",),
    ),
    Mutant(
        "a layer served eagerly kept on its kernel in the piecewise graphs", "ascend_compile/passes/pipeline.py",
        "        piecewise = _piecewise_variant(gm, pieces, piece_kernels, eager_layers)\n",
        "        piecewise = _piecewise_variant(gm, pieces, piece_kernels)\n",
        (f"{KERNEL_RULES}::test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning",),
    ),
    Mutant(
        "a full graph holding a layer served eagerly captured", "ascend_compile/targets.py",
        "        left = None if key.piecewise else next(iter(attention_nodes(gm)), None)\n", "        left = None\n",
        (f"{KERNEL_RULES}::test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning",),
    ),
    Mutant(
        "a layer's attention op not an eager node between pieces", "ascend_compile/passes/split_pieces.py",
        "    if any(is_op(node, op) for op in _ATTENTION):\n", "    if False:\n",
        (f"{KERNEL_RULES}::test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning",),
    ),
    # issue 47 item 5: MLA's piecewise steps on the kernel
    Mutant(
        "the captured sparse-mode rule applied to piecewise MLA calls", "ascend_compile/passes/npu_checks.py",
        "    sparse_mode = None if key.piecewise else 0 if key.decode else 3\n",
        "    sparse_mode = 0 if key.decode else 3\n",
        ("tests/test_mla_npu.py::test_a_decode_step_above_the_buckets_is_served_piecewise_on_the_mla_kernel",),
    ),
    # issue 47 item 4: the band probes at the layer's own form, a refusal read as neither
    Mutant(
        "the band edge probe at a fixed form", "ascend_compile/ops/npu/band_probe.py",
        "    heads, kv_heads, dim, block, q_len = form.heads, form.kv_heads, form.head_dim, form.block_size, EDGE_QUERY_LEN\n",
        "    heads, kv_heads, dim, block, q_len = 2, 2, 64, 128, EDGE_QUERY_LEN\n",
        (f"{NPU_BAND_EDGE}::test_the_band_probes_are_asked_at_each_windowed_layers_own_form_once_per_form",),
    ),
    Mutant(
        "the S=1 band probe at a fixed form", "ascend_compile/ops/npu/band_probe.py",
        "    heads, kv_heads, dim, block = form.heads, form.kv_heads, form.head_dim, form.block_size\n",
        "    heads, kv_heads, dim, block = 2, 2, 64, 128\n",
        (f"{NPU_BAND_EDGE}::test_the_band_probes_are_asked_at_each_windowed_layers_own_form_once_per_form",),
    ),
    Mutant(
        "the band edge probe's answer kept per sinks only", "ascend_compile/ops/npu/band_probe.py",
        "    edges = _EDGES.setdefault(kernels.torch_npu, {})\n    key = (str(kernels.device), form)\n",
        "    edges = _EDGES.setdefault(kernels.torch_npu, {})\n    key = (str(kernels.device), form.sinks)\n",
        (f"{NPU_BAND_EDGE}::test_the_band_probes_are_asked_at_each_windowed_layers_own_form_once_per_form",),
    ),
    Mutant(
        "a band probe call the device refuses fails the compile", "ascend_compile/ops/npu/band_probe.py",
        "    except RuntimeError as err:\n        log.warning(\"ascend_compile: the device refused a band probe",
        "    except ValueError as err:\n        log.warning(\"ascend_compile: the device refused a band probe",
        (f"{NPU_BAND_EDGE}::test_a_band_probe_call_the_device_refuses_is_read_as_neither",),
    ),
    Mutant(
        "MLA's workspace probe at the graph's own tokens whatever the device answers", "ascend_compile/ops/npu/workspace_queries.py",
        "        if tokens > MLA_PROBE_TOKENS:\n", "        if False:\n",
        ("tests/test_mla_npu.py::test_mlas_workspace_probe_is_sized_by_what_the_devices_answer_depends_on",),
    ),
    Mutant(
        "MLA's reserved workspace the simulator's formula", "ascend_compile/targets.py",
        "        return lambda site, *args: (probed if site.kernel == MLA else node_need)(site, *args)\n",
        "        return node_need\n",
        ("tests/test_mla_npu.py::test_the_mla_workspace_reserved_before_compiling_is_the_devices_answer",),
    ),
    # issue 48: a device out of streams stops further captures
    Mutant(
        "a device out of streams tried again for each new graph", "ascend_compile/lowering/capture_failures.py",
        "        if self.streams_out is not None and name not in self.captured:\n", "        if False:\n",
        (f"{CAPTURE_FAILURES}::test_after_the_device_runs_out_of_streams_no_new_graph_is_tried",
         f"{CAPTURE_FAILURES}::test_a_budget_of_streams_spent_costs_the_graphs_past_it_not_the_steps"),
    ),
    Mutant(
        "a graph captured before not captured again once the streams ran out",
        "ascend_compile/lowering/capture_failures.py",
        "        if self.streams_out is not None and name not in self.captured:\n",
        "        if self.streams_out is not None:\n",
        (f"{CAPTURE_FAILURES}::test_a_graph_captured_before_the_streams_ran_out_is_captured_again_when_its_inputs_move",),
    ),
    Mutant(
        "a full graph tried after the streams ran out", "ascend_compile/lowering/runner.py",
        "            self.failures.begin(entry.name)  # `NotTried` once the device's streams ran out\n", "",
        (f"{CAPTURE_FAILURES}::test_after_the_device_runs_out_of_streams_no_new_graph_is_tried",),
    ),
    Mutant(
        "a piecewise size tried after the streams ran out", "ascend_compile/lowering/piecewise_serve.py",
        "                art.failures.begin(graph.name)  # `NotTried` once the device's streams ran out\n", "",
        (f"{CAPTURE_FAILURES}::test_a_budget_of_streams_spent_costs_the_graphs_past_it_not_the_steps",),
    ),
    Mutant(
        "a rank not told that another's streams ran out", "ascend_compile/lowering/capture_failures.py",
        "        if outcome == STREAMS_RAN_OUT:\n", "        if outcome == STREAMS_RAN_OUT and error is not None:\n",
        ("tests/test_tensor_parallel.py::test_a_device_out_of_streams_on_one_rank_stops_the_captures_of_every_rank",),
    ),
    # issue 48: a warm start calls no npu probe
    Mutant(
        "the S=1 band probe's answer not kept in the plan", "ascend_compile/ops/npu/band_probe.py",
        "@plan_cache.remembered(\"npu_probes\", question=lambda kernels, form: (\"band at one query token\", form))\n",
        "",
        (f"{WARM_START}::test_on_npu_a_warm_start_calls_no_probe",),
    ),
    Mutant(
        "the band edge probe's answer not kept in the plan", "ascend_compile/ops/npu/band_probe.py",
        "@plan_cache.remembered(\"npu_probes\", question=lambda kernels, form: (\"band edge\", form))\n", "",
        (f"{WARM_START}::test_on_npu_a_warm_start_calls_no_probe",),
    ),
    Mutant(
        "the form probe's answers not kept in the plan", "ascend_compile/ops/npu/form_probe.py",
        "@plan_cache.remembered(\"npu_probes\", question=lambda kernels, shape, dtype, windowed, sinks: (",
        "@(lambda kind, question: lambda fn: fn)(\"npu_probes\", question=lambda kernels, shape, dtype, windowed, sinks: (",
        (f"{WARM_START}::test_on_npu_a_warm_start_calls_no_probe",),
    ),
    Mutant(
        "the band probes asked at the first step, outside the plan", "ascend_compile/targets.py",
        "            npu_band_probe.band_edge(self.runtime.kernels, form)\n"
        "            npu_band_probe.band_at_single_query(self.runtime.kernels, form)\n",
        "            pass\n",
        (f"{WARM_START}::test_on_npu_a_warm_start_calls_no_probe",),
    ),
    # issue 49: a workspace slot shared by a target and its drafter (`lowering/workspace_group.py`)
    Mutant(
        "the group's slot held weakly", "ascend_compile/lowering/workspace_group.py",
        "        self.slot = self.runtime.empty((nbytes,), torch.uint8)\n",
        "        self.slot = self.runtime.weak_alias(self.runtime.empty((nbytes,), torch.uint8))\n", (GROUP_REPLAYS,),
    ),
    Mutant(
        "a grown slot released under the graphs that read it", "ascend_compile/lowering/workspace_group.py",
        "            art.graphs.clear()\n            art.piecewise.clear()\n", "", (GROUP_REPLAYS,),
    ),
    Mutant(
        "the slot not grown for a member needing more", "ascend_compile/lowering/workspace_group.py",
        "            if self.slot is None or need > self.slot.numel():\n", "            if self.slot is None:\n",
        (GROUP_REPLAYS,),
    ),
    Mutant(
        "a member's slots in a new dict (dynamo's copy keeps the old slot)", "ascend_compile/lowering/workspace_group.py",
        "    art.workspaces.update(dict.fromkeys(art.workspaces, slot))\n",
        "    art.workspaces = dict.fromkeys(art.workspaces, slot)\n", (GROUP_REPLAYS,),
    ),
    Mutant(
        "a group's members each given the device's whole graph budget", "ascend_compile/lowering/budget.py",
        "        if budget is not None and taken:\n", "        if False:\n",
        (f"{GROUP}::test_members_share_the_runtimes_graph_budget",),
    ),
    Mutant(
        "group members not serialized", "ascend_compile/lowering/workspace_group.py",
        "            art.lock, art.group = self.lock, self\n", "            art.group = self\n",
        (f"{GROUP}::test_a_member_step_waits_for_another_member_step_in_another_thread",),
    ),
    Mutant(
        "a member on another runtime let in", "ascend_compile/lowering/workspace_group.py",
        "    if (runtime.name, runtime.device) != (own.name, own.device):\n", "    if False:\n",
        (f"{GROUP}::test_members_must_share_a_runtime",),
    ),
    Mutant(
        "a workspace group with a slot per bucket", "ascend_compile/config.py",
        "        if self.workspace_group is not None and not self.share_workspace:\n", "        if False:\n",
        (f"{GROUP}::test_group_and_model_names_are_checked",),
    ),
    Mutant(
        "a model name that is a path", "ascend_compile/config.py",
        "re.fullmatch(r\"[A-Za-z0-9_.-]+\", value)", "re.fullmatch(r\"[A-Za-z0-9_./-]+\", value)",
        (f"{GROUP}::test_group_and_model_names_are_checked",),
    ),
    Mutant(
        "two models' dumps in one folder", "ascend_compile/passes/dump.py",
        "*([model] if model else [])", "*[]",
        (f"{GROUP}::test_each_model_has_its_own_dump_and_update_table_in_inspect",),
    ),
    # issue 49 item 1: vLLM's EAGLE drafter compiled by us beside the target, named, in one workspace group
    Mutant(
        "vLLM: the drafter left uncompiled", "ascend_compile/integrations/vllm/drafter.py",
        "    model.compile(fullgraph=True, backend=configured_backend(vllm_config, model_tag))\n",
        "    pass\n",
        (f"{EAGLE}::test_eagle_drafter_and_target_compiled_by_us_propose_and_accept_as_eager",),
        vllm=True,
    ),
    Mutant(
        "vLLM-Ascend's plug-in compiles the target only", "ascend_compile/integrations/vllm/ascend_plugin.py",
        "    compile_runner_drafter(runner)\n", "",
        (f"{EAGLE}::test_the_plugin_compiles_the_drafter_beside_the_target_named_in_one_workspace_group",),
        vllm=True,
    ),
    Mutant(
        "vLLM: the drafter compiled under the target's name", "ascend_compile/integrations/vllm/drafter.py",
        "backend=configured_backend(vllm_config, model_tag))", "backend=configured_backend(vllm_config))",
        (f"{EAGLE}::test_the_plugin_compiles_the_drafter_beside_the_target_named_in_one_workspace_group",),
        vllm=True,
    ),
    Mutant(
        "vLLM: the target unnamed beside its drafter", "ascend_compile/integrations/vllm/options.py",
        '    return {"model_name": model_tag or TARGET_TAG, ', '    return {"model_name": model_tag, ',
        (f"{EAGLE}::test_each_engine_names_its_two_models_and_gives_them_one_workspace_group_of_its_own",
         f"{EAGLE}::test_the_plugin_compiles_the_drafter_beside_the_target_named_in_one_workspace_group"),
        vllm=True,
    ),
    Mutant(
        "vLLM: target and drafter a workspace slot each", "ascend_compile/integrations/vllm/options.py",
        '"workspace_group": group}', "}",
        (f"{EAGLE}::test_each_engine_names_its_two_models_and_gives_them_one_workspace_group_of_its_own",
         f"{EAGLE}::test_the_plugin_compiles_the_drafter_beside_the_target_named_in_one_workspace_group"),
        vllm=True,
    ),
    Mutant(
        "vLLM: one workspace group for every engine of a process", "ascend_compile/integrations/vllm/options.py",
        'SPECULATIVE_GROUP.format(id(getattr(vllm_config, "speculative_config", None)))', "SPECULATIVE_GROUP",
        (f"{EAGLE}::test_each_engine_names_its_two_models_and_gives_them_one_workspace_group_of_its_own",),
        vllm=True,
    ),
    Mutant(
        "vLLM's GPU runner never compiles its drafter", "ascend_compile/integrations/vllm/__init__.py",
        "        drafter.install(options.current_vllm_config())", "        pass",
        (f"{EAGLE}::test_vllms_gpu_runner_compiles_its_drafter_before_its_first_forward",),
        vllm=True,
    ),
    Mutant(
        "vLLM: the drafter compiled again at each forward", "ascend_compile/integrations/vllm/drafter.py",
        'if model is None or getattr(model, "_compiled_call_impl", None) is not None or ', "if model is None or ",
        (f"{EAGLE}::test_vllms_gpu_runner_compiles_its_drafter_before_its_first_forward",),
        vllm=True,
    ),
    Mutant(
        "vLLM: a drafter compiled where vLLM does not compile with ours", "ascend_compile/integrations/vllm/drafter.py",
        " or not ours(runner.vllm_config):", ":",
        (f"{EAGLE}::test_vllms_gpu_runner_compiles_its_drafter_before_its_first_forward",),
        vllm=True,
    ),
    Mutant(
        "piecewise: pieces captured on what earlier captures left, not on the step's values",
        "ascend_compile/lowering/piecewise.py",
        "        live = LiveCapture(self, runtime, step, args, workspace) if step is not None else None\n",
        "        live = None\n",
        ("tests/test_piecewise_live.py",),
    ),
    Mutant(
        "piecewise: a piece's static outputs left as its capture left them for the next capture",
        "ascend_compile/lowering/piecewise.py",
        "        if live is not None:\n            live.replay(captured)\n", "",
        ("tests/test_vllm_moe.py",), vllm33=True,
    ),
)


def apply(mutant: Mutant, root: Path) -> str:
    """Edit the copy under `root`; returns the original text, to restore."""
    path = root / mutant.path
    if not path.exists():
        raise LookupError(f"{mutant.name}: its edit does not apply: {mutant.path} does not exist (update the mutant)")
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise LookupError(f"{mutant.name}: its edit does not apply: {mutant.path} holds the text to replace "
                          f"{text.count(mutant.old)} times, expected once (update the mutant)")
    path.write_text(text.replace(mutant.old, mutant.new))
    return text


#: What each worker imports once, before it forks a child per mutant: about 8 s of every pytest start
#: (`python -X importtime`: torch._dynamo and sympy most of it), which 120 fresh interpreters paid each.
#: Never the package or its tests: each child imports those from its mutated copy. torch imports triton
#: itself, so the conftest's `TRITON_INTERPRET` is set after triton's import here as in a plain run.
#: In a vLLM venv, `vllm.platforms` too (about 4 s: vLLM's package, which imports torch._inductor): the
#: package never imports vLLM at import time, so a fresh run's first vLLM import is the same one, in
#: `tests/vllm_real.py`, which sets the platform only after it (what vLLM imports after the platform is
#: set is left to the child, as the tests' monkeypatched platform class must be the one vLLM holds).
PRELOAD = ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy", "numpy", "pytest", "hypothesis",
           "vllm.platforms")
LOG = ".mutant-pytest.log"  # in each copy: the output of the last mutant's tests
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=")


def worker() -> int:
    """`--worker`: import `PRELOAD`, then for each request on stdin (a JSON list: copy root, log path,
    tests) fork a child that runs pytest on those tests in that copy, its output into the log, and
    answer its exit status on stdout. The child starts as a fresh interpreter would, less the imports."""
    import importlib
    import json

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this venv (the vLLM ones have no hypothesis, the main one no vLLM): as in a fresh run
            pass
    tools_dir = str(Path(__file__).resolve().parent)
    for line in sys.stdin:
        root, log, tests = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 3
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(root)
                sys.path[:] = [root] + [p for p in sys.path if p not in ("", tools_dir)]
                os.environ["PYTHONPATH"] = root
                sys.dont_write_bytecode = True  # a .pyc of a mutated file, same size and second, is never reused
                import pytest

                code = int(pytest.main([*PYTEST_ARGS, *tests]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
    return 0


class Worker:
    """A `--worker` process of one interpreter, for one scratch copy at a time."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def run(self, root: Path, tests: tuple[str, ...]) -> tuple[int, str]:
        """(pytest's exit status, its output) for `tests` in the copy under `root`."""
        import json

        log = root / LOG
        self.proc.stdin.write(json.dumps([str(root), str(log), list(tests)]) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the mutant worker of {self.proc.args[0]} exited ({self.proc.wait()})")
        return json.loads(answer), log.read_text()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # it exited already (its error is in the output above)
            pass
        self.proc.wait()


def run_tests(tests: tuple[str, ...], root: Path, worker: Worker) -> tuple[bool, str]:
    """(whether the tests failed, the first failing test) in the copy under `root`, run by `worker`.
    A test that does not exist (renamed, re-parametrized) fails pytest too, which would count the mutant
    caught: where pytest found no test of a name, the unmutated tree is asked, and a name it does not
    collect either raises `LookupError` (a mutant that breaks its tests' collection is caught)."""
    code, output = worker.run(root, tests)
    if "ERROR: not found:" in output:
        missing = uncollected(tests, worker.python)
        if missing:
            raise LookupError(f"the tests {missing} do not exist (update the mutant)")
    failed = [line.split()[1] for line in output.splitlines()
              if line.startswith(("FAILED tests/", "ERROR tests/"))]  # not a log line ("ERROR 12-01 ...")
    return code != 0, (failed[0] if failed else f"pytest exit {code}")


def uncollected(tests: tuple[str, ...], python: str) -> list[str]:
    """Which of `tests` pytest does not collect in the unmutated tree, run by `python`."""
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=ROOT, capture_output=True, text=True)
    lines = (out.stdout + out.stderr).splitlines()
    return [line.split("not found:", 1)[1].strip() for line in lines if "ERROR: not found:" in line]


def _scratch_copy(root: Path) -> None:
    """What the mutants' tests need, copied under `root`."""
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, root / name)


class Copy:
    """One scratch copy of the repository, with a worker per interpreter its mutants' tests run in."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workers: dict[str, Worker] = {}

    def worker(self, python: str) -> Worker:
        if python not in self.workers:
            self.workers[python] = Worker(python)
        return self.workers[python]

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def _python(mutant: Mutant) -> str:
    """The interpreter of `mutant`'s tests; `LookupError` when its venv is missing."""
    if mutant.vllm:
        if not VLLM_PYTHON.exists():
            raise LookupError(f"{mutant.name}: its tests run vLLM's code, and there is no vLLM venv at {VLLM_PYTHON} "
                              f"(build it with .ci/vllm-venv .venv-vllm, or set ASCEND_COMPILE_VLLM_PYTHON)")
        return str(VLLM_PYTHON)
    if mutant.vllm33:
        if not VLLM33_PYTHON.exists():
            raise LookupError(f"{mutant.name}: its tests run vLLM 0.33's code, and there is no venv at {VLLM33_PYTHON} "
                              f"(build it with .ci/vllm33-venv, or set ASCEND_COMPILE_VLLM33_PYTHON)")
        return str(VLLM33_PYTHON)
    return sys.executable


def _try(mutant: Mutant, copies: "queue.Queue[Copy]", keep: str | None) -> tuple[Mutant, bool, str, float]:
    """Apply `mutant` in a free scratch copy, run its tests, restore the copy: (mutant, caught,
    failing test, seconds); with `keep`, pytest's output is kept there. A mutant whose edit no longer
    applies raises `LookupError`."""
    python = _python(mutant)
    copy = copies.get()
    start = time.perf_counter()
    try:
        original = apply(mutant, copy.root)
        try:
            failed, test = run_tests(mutant.tests, copy.root, copy.worker(python))
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(copy.root / LOG, Path(keep) / (mutant.name.replace("/", "_").replace(" ", "_") + ".log"))
        finally:
            (copy.root / mutant.path).write_text(original)
    finally:
        copies.put(copy)
    return mutant, failed, test, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only the mutants with these names")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--tests", nargs="*", help="run these tests against every mutant instead of its own (does "
                        "another test, e.g. the differential tester, catch it?); their output is kept in --keep")
    parser.add_argument("--keep", help="a folder to keep each mutant's pytest output in, as <mutant>.log")
    parser.add_argument("--changed-since", metavar="BASE", help="run only the mutants the change since commit BASE "
                        "touches (tools/mutants_changed.py says which and why; CI: .ci/mutants-base)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="mutants tried at once, each in its own scratch copy (default: the CPU count)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(mutants) != len(set(args.only)):
        print(f"no mutant named {sorted(set(args.only) - {m.name for m in mutants})} (--list names them)")
        return 2
    if args.changed_since:
        from mutants_changed import select

        mutants, why = select(mutants, ROOT, args.changed_since)
        print(why)
    if args.tests:
        mutants = [dataclasses.replace(m, tests=tuple(args.tests)) for m in mutants]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.path} -> {' '.join(m.tests)}")
        return 0
    if not mutants:
        print("0 caught, 0 survived")
        return 0
    caught = 0
    jobs = max(1, min(args.jobs, len(mutants)))
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        copies: queue.Queue[Copy] = queue.Queue()
        made = []
        for i in range(jobs):
            (Path(scratch) / str(i)).mkdir()
            _scratch_copy(Path(scratch) / str(i))
            made.append(Copy(Path(scratch) / str(i)))
            copies.put(made[-1])
        print(f"{'mutant':36} {'result':9} {'s':>5}  failing test")
        try:
            # the vLLM ones first: their tests build vLLM's models and are the longest (up to a minute), so
            # that no long one starts last while the other CPUs have nothing left to do
            order = sorted(mutants, key=lambda m: not (m.vllm or m.vllm33))
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                for mutant, failed, test, seconds in pool.map(lambda m: _try(m, copies, args.keep), order):
                    caught += failed
                    result = "caught" if failed else "SURVIVED"
                    print(f"{mutant.name:36} {result:9} {seconds:5.1f}  {test if failed else '-'}", flush=True)
        except LookupError as err:
            print(err)
            return 2
        finally:
            for copy in made:
                copy.close()
    print(f"{caught} caught, {len(mutants) - caught} survived")
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
