"""CompileConfig: every knob of the backend, validated once, also buildable from `options=`."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

from .ops.kernel_policy import PA_MAX_BATCH

DUMP_DIR_ENV = "ASCEND_COMPILE_DUMP_DIR"

KERNEL_POLICIES = ("pa_max_batch", "pa_batch_sizes", "auto", "pa", "fia")
RUNTIMES = ("auto", "sim", "npu", "cuda", "eager")
INNER_COMPILERS = ("eager", "inductor")
SIM_OVERFLOW = ("write", "raise")
REFUSED_LAYERS = ("raise", "eager")


def default_capture_sizes() -> tuple[int, ...]:
    """vLLM's default: 1, 2, 4, then steps of 8 up to 256."""
    return (1, 2, 4) + tuple(range(8, 257, 8))


#: The most tokens a piecewise step holds by default: vLLM's default `max_num_batched_tokens` for
#: online serving on a large GPU (8192, `vllm/engine/arg_utils.py`, `_set_default_args`).
PIECEWISE_MAX_TOKENS = 8192


def default_piecewise_sizes(capture_sizes: tuple[int, ...], largest: int = PIECEWISE_MAX_TOKENS) -> tuple[int, ...]:
    """The capture sizes up to `largest`, then doubling from the largest of them, then `largest`
    itself (a runtime's most tokens a step holds: vLLM's `max_num_batched_tokens`)."""
    sizes = {s for s in capture_sizes if s <= largest}
    size = max(sizes, default=1)
    while size * 2 < largest:
        size *= 2
        sizes.add(size)
    sizes.add(largest)
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Options of the `ascend_graph` backend (DESIGN.md §6).

    Attributes:
        capture_sizes: the buckets: padded token counts that each get their own captured graph.
        max_model_len: the longest sequence (KV length) any step may have; workspaces are sized for
            every length up to it, and longer ones are refused. Required for graphs with attention.
        kernel_policy: how a bucket's attention kernel is chosen for decode-only steps:
            "pa_max_batch" (PA up to `pa_max_batch`), "pa_batch_sizes" (PA exactly for
            `pa_batch_sizes`, like vLLM-Ascend's pa_shape_list), "auto" (time both kernels at
            compile time on the target runtime, keep the faster), "pa" or "fia" (always).
            Steps with several query tokens per sequence always use FIA: PA is decode-only.
        pa_max_batch: the threshold of "pa_max_batch".
        pa_batch_sizes: the explicit PA buckets of "pa_batch_sizes".
        auto_seq_len: the context length "auto" times the kernels at (default min(1024, max_model_len)).
        workspace_seq_len: None sizes workspaces for the exact maximum over [1, max_model_len]; an
            int pins one length instead (the SEQ_LEN_WITH_MAX_PA_WORKSPACE way; may under-size).
        workspace_probe_lens: on "npu", whose kernels have no workspace formula, the lengths PA's
            workspace query is asked at, at compile time (the largest answer is kept; FIA's query
            answers for every length and is asked once per graph). None: once per graph, at the
            length PA graphs are captured at (6144, or max_model_len if shorter), with
            `pa_workspace_check` catching steps that need more. Each at most max_model_len.
        pa_workspace_check: on "npu", ask PA's workspace query with each step's lengths before its
            replay (one query per step and PA shape, as vLLM-Ascend asks at every update) and run a
            step needing more than its slot eagerly; False trusts the compile-time answers.
        share_workspace: one workspace slot for all buckets (True) or one per bucket.
        runtime: "auto" (npu for graphs on an NPU when torch_npu imports and reports a device,
            the simulator for CPU graphs, cuda for CUDA graphs, eager elsewhere), "sim" (the CPU
            ACL-graph simulator), "npu" (ACL graphs through torch_npu, with task-group updates),
            "cuda" (CUDA graphs; the kernels read lengths from device buffers), "eager" (no graphs:
            each bucket graph runs directly).
        inner_compiler: how the non-attention ops run inside a graph: "eager" (op by op), or
            "inductor" (compiled by inductor for each bucket, attention staying our op; runtime
            "cuda" only).
        clone_outputs: return copies of the graph's static outputs (False: views into the graph
            pool all buckets share, which the next step of any bucket overwrites).
        capture_all: capture every bucket's decode graph at the first call instead of on first use.
        piecewise_sizes: the token counts piecewise graphs are captured for (`lowering/piecewise.py`):
            a step no full graph serves (above the largest bucket, refused by the target, its graph
            uncapturable or found differing by `verify`) runs as captured pieces between its
            attention and uncapturable ops, padded to the smallest size holding it; above the
            largest it runs eagerly. None: the capture sizes, then doubling up to 8192; [] turns
            piecewise graphs off.
        graph_budget: the most graphs a compile plans to capture (full graphs, and each piecewise size's
            pieces); piecewise sizes past it are dropped, the largest kept, with a WARNING
            (`lowering/budget.py`). None: the runtime's (npu: vLLM-Ascend's 1,800; the simulator: its
            `stream_budget`; cuda: none).
        plan_dir: where a compile keeps its deterministic answers (kernel timings, workspace queries) for the
            next start, keyed by graph, options, versions, device and rank (`plan_cache.py`); None: none kept.
        refused_layers: what a layer whose form the device's kernel refuses does (npu: the FIA form probe,
            `ops/npu/form_probe.py`, where CANN versions differ): "raise" (a compile-time error naming the
            layer and the device's message) or "eager" (its attention runs eagerly as traced, between the
            captured pieces of piecewise graphs, which then serve every step of the graphs holding it; one
            WARNING names the layers).
        sim_overflow: what the simulator does when a kernel needs more workspace than it got:
            "write" past the buffer, like the device, or "raise".
        max_specializations: the most captures one bucket keeps for distinct values of the sizes
            it cannot pad (e.g. a fixed-size caller buffer under dynamic=True, or every size where
            padding would change what the step writes); steps with further values run eagerly.
        frozen_parameters: the model's parameters keep their addresses for the artifact's life (as
            vLLM's weight loading and sleep mode keep them, and torchair's `frozen_parameter`
            assumes): their per-step address check is skipped, about 0.1 us per parameter; each is
            only checked to be the object the graph was captured with (parameters assigned anew,
            or another model of the same class served by the same graph, are captured again). False:
            every in-place input (parameters included) is checked each step, and one that moved
            (`p.data = t`, a module moved away and back) is captured again. A parameter that moves
            under True feeds the graph stale memory; KV caches and buffers are checked either way.
        save_cache_rows: before every step, save the KV-cache rows its cache writes will overwrite and
            put them back if the step raises (one gather per written cache, every step, outside the
            graph: `lowering/undo.py`). False (the default), as serving runtimes run: a step that raises
            has written at most its own tokens' slots, the error says which (sequences, slot range), and
            the same step run again (as vLLM re-schedules it) writes them anew. Inputs a plain op writes
            whole (a step counter) are saved either way. For tests and the differential tester.
        verify: check each captured graph's first replay against the step run eagerly (outputs and
            every input the step writes, within a tolerance per dtype); a graph that differs is
            logged, recorded in plan.json and serves its steps eagerly. None: on for the devices
            ("npu", "cuda"), where no test of ours ran, off on the simulator and "eager".
        verify_every: with `verify` on, check every Nth replay of each graph too (its 1st, N+1th,
            2N+1th, ...: a fault that appears later, such as a parameter moved under
            `frozen_parameters`); each check costs an eager step. 0 (the default): the first only.
        workspace_group: a name: the compiled graphs of every model compiled with the same name share one
            attention-workspace slot, sized for the largest need of all of them, and one runtime (one graph
            pool), so that a drafter beside its target costs no second slot (`lowering/workspace_group.py`).
            Their steps then run one at a time (one lock); members must not replay on two device streams
            that overlap. A member needing more than the slot holds grows it, and the others' captured
            graphs are captured again. Needs `share_workspace`. None: a slot of the model's own.
        model_name: the model's name in dumps (`dump_dir/<model_name>/graph_N`), plan.json, `inspect` and
            its workspace group: letters, digits, `_`, `-` and `.`. None: unnamed.
        dump_dir: write every stage of every bucket and a plan.json here (env ASCEND_COMPILE_DUMP_DIR).
        retrace_static: when dynamo hands over a graph whose caller inputs have static sizes (the
            first call of a plain `torch.compile`), have dynamo trace the frame again with every
            step size symbolic, so that one compile serves every step shape
            (`compile_once.retrace_general`: one more dynamo trace, dynamo internals). Not needed
            with `ascend_compile.compile`, whose first trace is general.
    """

    capture_sizes: tuple[int, ...] = dataclasses.field(default_factory=default_capture_sizes)
    max_model_len: int | None = None
    kernel_policy: str = "pa_max_batch"
    pa_max_batch: int = PA_MAX_BATCH
    pa_batch_sizes: tuple[int, ...] = ()
    auto_seq_len: int | None = None
    workspace_seq_len: int | None = None
    workspace_probe_lens: tuple[int, ...] | None = None
    pa_workspace_check: bool = True
    share_workspace: bool = True
    runtime: str = "auto"
    inner_compiler: str = "eager"
    clone_outputs: bool = True
    capture_all: bool = False
    sim_overflow: str = "write"
    max_specializations: int = 8
    frozen_parameters: bool = False
    save_cache_rows: bool = False
    verify: bool | None = None
    verify_every: int = 0
    dump_dir: str | None = None
    retrace_static: bool = False
    piecewise_sizes: tuple[int, ...] | None = None
    graph_budget: int | None = None
    plan_dir: str | None = None
    workspace_group: str | None = None
    model_name: str | None = None
    refused_layers: str = "raise"

    def __post_init__(self) -> None:
        sizes = tuple(self.capture_sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"capture_sizes: expected a non-empty list of positive ints, got {self.capture_sizes!r}")
        object.__setattr__(self, "capture_sizes", tuple(sorted(set(sizes))))
        object.__setattr__(self, "pa_batch_sizes", tuple(sorted(set(self.pa_batch_sizes))))
        pieces = default_piecewise_sizes(sizes) if self.piecewise_sizes is None else tuple(self.piecewise_sizes)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in pieces):
            raise ValueError(f"piecewise_sizes: expected a list of positive ints ([] turns piecewise graphs off), "
                             f"got {self.piecewise_sizes!r}")
        object.__setattr__(self, "piecewise_sizes", tuple(sorted(set(pieces))))
        _check_optional_positive("max_model_len", self.max_model_len)
        _check_optional_positive("graph_budget", self.graph_budget)
        _check_optional_positive("auto_seq_len", self.auto_seq_len)
        _check_optional_positive("workspace_seq_len", self.workspace_seq_len)
        _check_positive("pa_max_batch", self.pa_max_batch)
        _check_positive("max_specializations", self.max_specializations)
        if self.workspace_probe_lens is not None:
            lens = self.workspace_probe_lens
            if not isinstance(lens, (list, tuple)) or not lens or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lens
            ):
                raise ValueError(f"workspace_probe_lens: expected a non-empty list of positive ints, got {lens!r}")
            if self.max_model_len and max(lens) > self.max_model_len:
                raise ValueError(
                    f"workspace_probe_lens: expected lengths of at most max_model_len ({self.max_model_len}), "
                    f"got {max(lens)}"
                )
            object.__setattr__(self, "workspace_probe_lens", tuple(sorted(set(lens))))
        if any(not isinstance(s, int) or s < 1 for s in self.pa_batch_sizes):
            raise ValueError(f"pa_batch_sizes: expected positive ints, got {self.pa_batch_sizes!r}")
        _check_choice("kernel_policy", self.kernel_policy, KERNEL_POLICIES)
        _check_choice("runtime", self.runtime, RUNTIMES)
        _check_choice("inner_compiler", self.inner_compiler, INNER_COMPILERS)
        _check_choice("sim_overflow", self.sim_overflow, SIM_OVERFLOW)
        _check_choice("refused_layers", self.refused_layers, REFUSED_LAYERS)
        for name in ("share_workspace", "clone_outputs", "capture_all", "retrace_static", "frozen_parameters",
                     "save_cache_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.verify is not None and not isinstance(self.verify, bool):
            raise ValueError(f"verify: expected True, False or None (on for the devices), got {self.verify!r}")
        if not isinstance(self.verify_every, int) or isinstance(self.verify_every, bool) or self.verify_every < 0:
            raise ValueError(f"verify_every: expected an int >= 0 (0: the first replay only), got {self.verify_every!r}")
        if self.max_model_len and self.workspace_seq_len and self.workspace_seq_len > self.max_model_len:
            raise ValueError(
                f"workspace_seq_len: expected at most max_model_len ({self.max_model_len}), got {self.workspace_seq_len}"
            )
        for name in ("workspace_group", "model_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", value)
                                      or set(value) == {"."}):
                raise ValueError(f"{name}: expected a name of letters, digits, '_', '-' and '.', got {value!r}")
        if self.workspace_group is not None and not self.share_workspace:
            raise ValueError(f"workspace_group: {self.workspace_group!r} shares one slot between models, which "
                             f"share_workspace=False (a slot per bucket) contradicts")
        if self.dump_dir is None and os.environ.get(DUMP_DIR_ENV):
            object.__setattr__(self, "dump_dir", os.environ[DUMP_DIR_ENV])

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "CompileConfig":
        """A config from `torch.compile(..., options=...)`; unknown keys are an error listing the valid ones."""
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"options: unknown option(s) {unknown}; valid options are {valid}")
        for key in ("capture_sizes", "pa_batch_sizes", "workspace_probe_lens", "piecewise_sizes"):
            if key in options and options[key] is not None and not isinstance(options[key], (list, tuple)):
                raise ValueError(f"{key}: expected a list of ints, got {options[key]!r}")
        return cls(**options)

    @property
    def auto_timing_seq_len(self) -> int:
        """The context length the "auto" policy times kernels at."""
        if self.auto_seq_len is not None:
            return self.auto_seq_len
        return min(1024, self.max_model_len or 1024)


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _check_optional_positive(name: str, value: Any) -> None:
    if value is not None:
        _check_positive(name, value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
