"""The Ascend runtime: ACL graphs through torch_npu (`torch.npu.NPUGraph`) with task-group updates.

Per compiled artifact: one graph memory pool shared by every bucket's graph (buckets never replay at
once), one capture stream, and one update stream limited to the cores each graph was captured for.
Only the first capture empties the caching allocators. Each attention kernel is captured as
`ExternalEvent.wait` + `reset` on the capture stream, then `graph_task_group_begin`, the torch_npu
kernel, `graph_task_group_end` -> handle. Each step the runner launches the replay first, then for
every kernel issues `graph_task_update_begin(update_stream, handle)`, the kernel with the step's
host lengths, `graph_task_update_end`, and `event.record(update_stream)`, so the updates run while
the replay is already on the device, which waits at each kernel for its update's event. torch_npu
is imported when a runtime is made, never when this module is."""
from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any, Callable, ContextManager, Iterator

import torch

from ..errors import AscendCompileError, CaptureError, ReplayError
from ..ops.npu import api as npu_api
from ..ops.npu.kernels import NpuKernels, load_torch_npu
from .base import DeviceGraph, TaskHandle, TaskUpdateRuntime, generators_kept
from .npu_tasks import NpuEvent, NpuTaskHandle

log = logging.getLogger("ascend_compile")

#: The torch device type of NPU tensors (torch_npu renames PrivateUse1 to it when imported).
NPU_DEVICE_TYPE = "npu"

#: A stream's core limit as `torch.npu.get_stream_limit` reports it: {"cube_core_num": n, "vector_core_num": m}.
CoreLimit = dict[str, int]


def available() -> bool:
    """Whether torch_npu imports and reports at least one NPU."""
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available()) and torch.npu.device_count() > 0
    except (ImportError, OSError, RuntimeError, AttributeError) as err:
        log.debug("ascend_compile: torch_npu is not usable: %s", err)
        return False


class NpuGraph(DeviceGraph):
    """One `torch.npu.NPUGraph`, captured into the runtime's shared pool on its capture stream."""

    warms_up = True

    def __init__(self, runtime: "NpuRuntime", name: str) -> None:
        self._runtime = runtime
        self.name = name
        self.native = runtime.npu.NPUGraph()
        self.groups = 0
        self.captured = False
        self.host_tensors: list[torch.Tensor] = []
        self.core_limit: CoreLimit | None = None  # the cores its kernels were tiled for, set at capture

    def warmup(self, run: Callable[[], Any]) -> None:
        """Run the graph's work once eagerly, then synchronize, before its capture: ATB and aclnn set
        an op up on its first call (tiling caches, kernel binaries, allocations), which must not
        happen inside a global-mode capture. vLLM-Ascend runs eager dummy steps before each capture
        (`vllm_ascend/worker/model_runner_v1.py`, `_dummy_run`), and torch_npu's
        `make_graphed_callables` warms up with a synchronize on both sides (`torch_npu/npu/graphs.py`).
        The run leaves the generators as it found them (`base.generators_kept`): its random ops must
        not consume the numbers the step's replay then draws."""
        rt = self._runtime
        rt.synchronize()
        with rt.generators_kept():
            run()
        rt.synchronize()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the work issued in this context into the graph (pool and stream of the runtime),
        under `generators_kept` as torch_npu's own recordings are (`torch_npu/npu/_graph_tree.py`).

        It does what `torch.npu.graph` does on entry and exit (`torch_npu/npu/graphs.py`, `graph.__enter__`:
        `synchronize`, `empty_cache`, `host_empty_cache`, then `capture_begin` on the capture stream;
        `__exit__`: `capture_end`) but empties the two caching allocators only before the runtime's first
        capture (`NpuRuntime.prepare_capture`), and tiles the kernels for the cores of the stream the
        graph will replay on."""
        rt = self._runtime
        if rt.capturing is not None:
            raise CaptureError(f"cannot capture {self.name}: {rt.capturing.name} is being captured")
        if self.captured:
            raise CaptureError(f"{self.name} was already captured; capture into a new graph")
        rt.capturing = self
        try:
            self.core_limit = rt.prepare_capture()  # synchronized: the host tensors of earlier work are freed
            with rt.generators_kept(), rt.npu.stream(rt.capture_stream):
                self.native.capture_begin(pool=rt.pool)
                try:
                    yield
                except BaseException:
                    self._end_failed_capture()
                    raise
                self.native.capture_end()
        finally:
            rt.capturing = None
            group_open, rt.group_open = rt.group_open, False
            # The captured tasks read these until a task update replaces them: they live with the graph.
            self.host_tensors = rt.kernels.take_host_tensors()
        if group_open:
            raise CaptureError(f"capture of {self.name} ended inside a task group: call task_group_end()")
        self.captured = True

    def _end_failed_capture(self) -> None:
        """End a capture whose work raised (an op that cannot be captured): the stream leaves capture
        mode, and an error `capture_end` raises for the invalidated capture is logged, not raised, so
        that the work's own error, which names the op, reaches the runner."""
        try:
            self.native.capture_end()
        except RuntimeError as err:
            log.debug("ascend_compile: %s: capture_end after a failed capture: %s", self.name, err)

    def replay(self) -> None:
        """Launch the graph on the current stream, ordered after the previous step (see
        `NpuRuntime.order_after_previous_step`); its updates may be issued right after."""
        rt = self._runtime
        if not self.captured:
            raise ReplayError(f"{self.name} cannot be replayed: it was never captured (or its capture failed)")
        if rt.capturing is not None:
            raise ReplayError(f"cannot replay {self.name} while {rt.capturing.name} is being captured")
        stream = rt.npu.current_stream()
        if stream == rt.update_stream:
            raise ReplayError(
                f"{self.name}: replayed on the update stream; the graph waits for events the updates record "
                f"on that stream, behind it: it would hang. Replay on another stream"
            )
        rt.order_after_previous_step()
        self.native.replay()
        rt.step_done(stream)
        rt.limit_update_stream(self.core_limit)


class NpuRuntime(TaskUpdateRuntime):
    """ACL-graph capture and replay through torch_npu, with task-group updates on a side stream.

    Steps are ordered on the device, as torchair's npugraph_ex orders them: each replay makes the
    update stream wait for an event recorded on the replay stream right after the previous replay.
    Without it, the updates of step N+1 (and their `ExternalEvent.record`) could run before replay N
    reached the `reset` of the same events: replay N's reset would erase step N+1's record and
    replay N+1 would wait forever (the known hang of reusing events across steps), and updates could
    rewrite a task replay N has not run yet. Per-step events cannot replace this: the events are
    captured into the graph, so every replay waits on the same ones. The runner's `synchronize()`
    after each step orders steps on the host too; this ordering does not rely on it.
    """

    name = "npu"
    verify_first_replays = True

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.torch_npu = load_torch_npu()
        self.npu = torch.npu
        self.torch_npu_version: str = getattr(self.torch_npu, "__version__", "unknown")
        #: What the installed torch_npu lacks of what this runtime may call (`ops/npu/api.py`): the graph
        #: API required here, a kernel's functions by the graphs holding it (`NpuTarget.check_graph`).
        self.api_absent = npu_api.missing(self.torch_npu, self.npu)
        npu_api.require(npu_api.GRAPH_API, self.api_absent, self.torch_npu_version, "runtime 'npu'")
        device = torch.device(device) if device is not None else torch.device(NPU_DEVICE_TYPE, self.npu.current_device())
        if device.type != NPU_DEVICE_TYPE:
            raise ValueError(
                f"runtime: 'npu' runs graphs whose tensors are on an NPU ({NPU_DEVICE_TYPE!r}), "
                f"but the graph's tensors are on {device}"
            )
        self._device = device
        self.kernels = NpuKernels(self.torch_npu, device)
        self.capture_stream = self.npu.Stream(device)
        # High priority, like npugraph_ex's: updates must not queue behind other work of this step.
        self.update_stream = self.npu.Stream(device, priority=-1)
        self.pool = self.npu.graph_pool_handle()
        self._core_limits = True  # until `get_stream_limit` fails (an older CANN): see `stream_limit`
        self._update_core_limit: CoreLimit | None = self.stream_limit(self.update_stream)
        self._captures = 0
        self._previous_step = self.npu.Event()
        self._steps = 0
        #: host tensors given to eager kernels of piecewise steps, each list with an event marking its step's end
        self._held: list[tuple[Any, list[torch.Tensor]]] = []
        self._graph_count = 0
        self._update: NpuTaskHandle | None = None
        self._update_ctx: contextlib.ExitStack | None = None
        self.capturing: NpuGraph | None = None
        self.group_open = False

    @property
    def device(self) -> torch.device:
        """The NPU the graphs run on."""
        return self._device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Device memory from torch_npu's caching allocator (the graph pool during a capture)."""
        return torch.empty(tuple(shape), dtype=dtype, device=self._device)

    def graph(self, label: str = "") -> NpuGraph:
        """A new graph; every graph of this runtime captures into its one pool (`label`: the runner's name)."""
        self._graph_count += 1
        return NpuGraph(self, f"graph{self._graph_count}" + (f" ({label})" if label else ""))

    def event(self, name: str) -> NpuEvent:
        """A new `torch.npu.ExternalEvent` named `name` in errors."""
        return NpuEvent(self, name)

    def task_group_begin(self) -> None:
        """Inside capture: `graph_task_group_begin` on the capture stream."""
        graph = self._require_capture("task_group_begin()")
        if self.group_open:
            raise CaptureError("task_group_begin(): a task group is already open (task groups do not nest)")
        self.npu.graph_task_group_begin(self.capture_stream)
        self.group_open = True
        graph.groups += 1

    def task_group_end(self) -> NpuTaskHandle:
        """Inside capture: `graph_task_group_end` on the capture stream; its handle."""
        graph = self._require_capture("task_group_end()")
        if not self.group_open:
            raise CaptureError("task_group_end() without task_group_begin()")
        native = self.npu.graph_task_group_end(self.capture_stream)
        self.group_open = False
        return NpuTaskHandle(native, graph, graph.groups - 1)

    def task_update_begin(self, handle: TaskHandle) -> None:
        """Outside capture: make the update stream current and `graph_task_update_begin` on it."""
        if not isinstance(handle, NpuTaskHandle) or handle.graph._runtime is not self:
            raise AscendCompileError(f"task_update_begin(): {handle!r} is not a task group of this runtime")
        if self.capturing is not None:
            raise CaptureError("task_update_begin() during capture: task updates are issued outside capture")
        if self._update is not None:
            raise AscendCompileError(f"task_update_begin(): the update of {self._update!r} is still open")
        ctx = contextlib.ExitStack()
        ctx.enter_context(self.npu.stream(self.update_stream))
        try:
            self.npu.graph_task_update_begin(self.update_stream, handle.native)
        except BaseException:
            ctx.close()
            raise
        self._update, self._update_ctx = handle, ctx

    def task_update_end(self) -> None:
        """`graph_task_update_end` on the update stream, then restore the current stream."""
        if self._update is None or self._update_ctx is None:
            raise AscendCompileError("task_update_end() without task_update_begin()")
        ctx, self._update, self._update_ctx = self._update_ctx, None, None
        with ctx:
            self.npu.graph_task_update_end(self.update_stream)

    def generators_kept(self) -> ContextManager[None]:
        """The CPU generator and this NPU's default generator, put back when the block ends.

        Random ops in an ACL graph (torch_npu 2.14, read in its wheel: `torch_npu/npu/graphs.py`,
        `torch_npu/npu/random.py`, `torch_npu/utils/_dynamo.py` and the strings of
        `torch_npu/lib/libtorch_npu.so`, from `torch_npu/csrc/aten/NPUGeneratorImpl.cpp`) follow
        CUDA's contract: `NPUGeneratorImpl` keeps a per-capture state (seed and offset in device
        tensors, an intra-graph offset; the aclnn random kernels, `multinomial` among them, take
        `*seed_ptr, *offset_ptr, offset_intragraph`), registered automatically when a random op
        first runs in a capture (`NPUGraph.register_generator_state()` is a deprecated no-op);
        each replay's `replay_prologue` reads the generator's seed and offset and advances it by
        the graph's total, so replays draw fresh numbers and a capture advances no eager state;
        torch_npu registers "npu" for upstream graph-safe RNG (`register_npu_graphsafe_rng`).
        torch_npu 2.10.0.post4 has neither `replay_prologue` nor `register_npu_graphsafe_rng`: that its
        replays advance the generator was not read there (docs/ascend.md). What is left to us:
        the eager warm-up before a capture must not draw from the step's generators, and the capture
        runs as torch_npu's own recordings do (under `preserve_rng_state`, `torch_npu/npu/_graph_tree.py`)."""
        return generators_kept(self.npu, self._device)

    def synchronize(self) -> None:
        """Wait for everything launched on the device: replays and updates. Host tensors passed to
        the kernels launched meanwhile are read by then and may be freed."""
        self.synchronizes += 1
        self.npu.synchronize(self._device)
        self.kernels.take_host_tensors()
        self._held.clear()

    def after_piecewise_step(self) -> None:
        """No synchronize: the host tensors the step's eager kernels were given (PA's `context_lens`)
        are held until an event recorded now on the current stream has passed, checked (never waited
        for) at each later piecewise step's end."""
        self._held = [(event, held) for event, held in self._held if not event.query()]
        event = self.npu.Event()
        event.record(self.npu.current_stream())
        self._held.append((event, self.kernels.take_host_tensors()))

    def kernel(self, op: Any) -> Callable[..., Any]:
        """The torch_npu binding of an ascend op (PA, FIA, MLA, the KV-cache writes); any other op runs as itself."""
        packet = getattr(op, "overloadpacket", op)
        if packet is torch.ops.ascend.paged_attention:
            return self.kernels.paged_attention
        if packet is torch.ops.ascend.fused_infer_attention:
            return self.kernels.fused_infer_attention
        if packet is torch.ops.ascend.reshape_and_cache:
            return self.kernels.reshape_and_cache
        if packet is torch.ops.ascend.mla_fused_infer_attention:
            return self.kernels.mla_fused_infer_attention
        if packet is torch.ops.ascend.mla_cache_write:
            return self.kernels.mla_cache_write
        return op

    def weak_alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """`torch_npu._C._weak_ref_tensor`: the same memory, without keeping it allocated."""
        if tensor.device.type != self._device.type:
            return tensor
        return self.torch_npu._C._weak_ref_tensor(tensor)

    def prepare_capture(self) -> CoreLimit | None:
        """Before a capture: wait for the device; before the first capture only, release both caching
        allocators' unused blocks, as `torch.npu.graph` does before every capture. Every later capture
        skips them, as vLLM-Ascend's does (it patches `torch.npu.empty_cache` and `gc.collect` out for
        every graph after the first, `vllm_ascend/compilation/acl_graph.py`): graphs captured lazily
        while serving would otherwise give the allocator's cache back on each first use of a bucket.

        Then the capture stream takes the core limit of the current stream, where the graph replays,
        so its kernels are tiled for the cores it runs on; returns that limit. `set_stream_limit` turns
        on core control for the whole process (each later aclnn call queries it, the comment of
        `_set_stream_limit` in torch_npu's `npugraph_ex/_acl_concrete_graph/acl_graph.py`), so a limit
        is set only where it differs."""
        self.synchronize()
        if not self._captures:
            self.npu.empty_cache()
            self.npu.host_empty_cache()
        self._captures += 1
        limit = self.stream_limit(self.npu.current_stream())
        if limit is not None and self.stream_limit(self.capture_stream) != limit:
            self.npu.set_stream_limit(self.capture_stream, limit["cube_core_num"], limit["vector_core_num"])
        return limit

    def graph_budget(self) -> tuple[int | None, str]:
        """vLLM-Ascend's cap on ACL graphs, 1,800 (`MAX_CAPTURE_SIZE`, "Maximum number of graphs that can be
        captured by ACL Graph", `vllm_ascend/utils.py`, `update_aclgraph_sizes`: each graph holds a stream,
        and a device past its streams refuses `capture_begin` with 207008). torch_npu has no query for it:
        `get_stream_limit` answers a stream's cube and vector cores (torch_npu 2.10.0.post4
        `npu/npu_config.py`), not how many streams are left."""
        return 1800, "vLLM-Ascend's MAX_CAPTURE_SIZE (vllm_ascend/utils.py, update_aclgraph_sizes)"

    def stream_limit(self, stream: Any) -> CoreLimit | None:
        """`torch.npu.get_stream_limit(stream)`, or None where the installed torch_npu / CANN cannot say
        (it reads the limit through `_npu_get_stream_res_limit`, which an older CANN lacks): the runtime
        then captures and updates on the streams' own cores and sets no limit, logged once, as npugraph_ex
        does (`_save_stream_core_limits` in `npugraph_ex/_acl_concrete_graph/acl_graph.py` catches the
        error, warns and records no limit, whose update then sets none)."""
        if not self._core_limits:
            return None
        try:
            return self.npu.get_stream_limit(stream)
        except (AttributeError, RuntimeError) as err:
            self._core_limits = False
            log.warning("ascend_compile: torch.npu.get_stream_limit failed (%s): graphs are captured and updated "
                        "on the streams' own cores, no core limit is set", err)
            return None

    def limit_update_stream(self, limit: CoreLimit | None) -> None:
        """Before a graph's task updates: the update stream limited to the cores the graph was captured
        for. A task update tiles its kernel again on the host, for the cores of the stream it is issued
        on; npugraph_ex sets the update stream's limit to the captured one before every update
        (`npugraph_ex/_acl_concrete_graph/acl_graph.py`, the limit recorded at capture in
        `fx2acl_converter.py`). The update stream is this runtime's own, so its limit is known here and
        set only when a graph needs another."""
        if limit is not None and limit != self._update_core_limit:
            self.npu.set_stream_limit(self.update_stream, limit["cube_core_num"], limit["vector_core_num"])
            self._update_core_limit = dict(limit)

    def order_after_previous_step(self) -> None:
        """Make the update stream wait until the previous step's replay has finished."""
        if self._steps:
            self.update_stream.wait_event(self._previous_step)

    def step_done(self, replay_stream: Any) -> None:
        """Mark, on the replay stream, the end of the replay just launched (for the next step)."""
        self._previous_step.record(replay_stream)
        self._steps += 1

    def replay_failed(self) -> None:
        """The failed step's end may never have been recorded (the simulated device drops queued work
        on an error, as after a device reset): the next replay must not wait for it."""
        self._previous_step = self.npu.Event()
        self._steps = 0

    def describe(self) -> dict[str, Any]:
        """What the dump records about this runtime."""
        return {**super().describe(), "torch_npu": self.torch_npu_version}

    def _require_capture(self, what: str) -> NpuGraph:
        if self.capturing is None:
            raise CaptureError(f"{what} outside capture")
        return self.capturing
