"""The ACL-graph simulator: a device-graph runtime on the CPU that behaves like the device.

It is the default runtime on CPU and the test bed for the passes, the lowering and the runner
(DESIGN.md §5), so it must fail where an Ascend ACL graph (or a CUDA graph) fails instead of
quietly computing the eager answer:

- capture records ops as **tasks** (a `TorchDispatchMode`); their operands are memory addresses, and
  everything allocated during a capture is poisoned (0xFF bytes: NaN, -1) when it ends, so nothing
  can depend on capture-time values;
- an op is one task only where the device has a kernel for it (torch's own ops, and those the
  runtime declares, `SimRuntime(device_kernels=...)`: by default `SIM_KERNELS`); any other op,
  Python custom ops included, is recorded as the ops its body issues, so a host read inside it fails
  the capture naming the op, and a replay runs none of its Python;
- memory comes from simulated device pools with addresses (`pool.py`): a block freed during a
  capture is handed to a later allocation of that capture or of a later one;
- host arguments (lists of ints) are frozen at capture; only a task update changes them, and it must
  issue the same ops as the task group it replaces;
- a kernel short of workspace writes past it into its neighbours (or raises, by option);
- the device runs work asynchronously on **streams** (`streams.py`): a default, a capture and an
  update stream (more with `new_stream`). `SimGraph.replay` queues the graph's tasks on a stream,
  `task_update_end` queues the update on the update stream, events are recorded, waited on and reset
  on streams, and the queues drain on `synchronize` (or `advance`). Only events order two streams;
- a task update and a replay's kernel that no event orders are a race (`StreamRace`), as is a host
  write into a static input of a replay launched and not yet run (`ReplayError`); a replay waiting on
  an event that nothing queued can record raises naming the node, instead of hanging;
- a kernel with a zero-length fast path (`SimRuntime.zero_length_fast_path`; by default the ascend
  PA and FIA) called with every length 0 launches another task than with real lengths, so a task
  captured that way cannot be updated to real lengths (the update is refused);
- host tensor inputs of a kernel (`SimRuntime.copies_host_inputs`, e.g. ATB's CPU `context_lens`)
  are copied when the call is issued, as torch_npu's ATB binding does: freeing or overwriting the
  caller's tensor afterwards changes nothing;
- an op that sets itself up on its first call (`SimRuntime.first_call`) may not make that call
  inside a capture;
- a capture past the device's stream budget (`SimRuntime(stream_budget=...)`) fails at `capture_begin`
  with the device's error 207008, and `SimRuntime.faults.inject` fails chosen captures as the device
  can (at `capture_begin`, inside, at `capture_end`), for the runner's handling of a failed capture;
- host reads of device data during capture (`.item()`, `.tolist()`, data-dependent shapes) raise;
- random ops (a sampler's `multinomial`) draw from the CPU generator when a replay runs them, fresh
  numbers each replay; a capture draws nothing (the generator is put back), as on CUDA and torch_npu;
- a functional collective (`_c10d_functional`) is a device task of the replay's stream whose output
  reaches its captured address only when its work completes: at the graph's `wait_tensor` of it, or
  at the end of the graph; every replay issues it again, in captured order.

The modules, each importing only those above it in this list: `faults` (the captures the device
refuses: a stream budget, injected faults), `pool` (segments and blocks),
`streams` (queues, events, races), `classify` (what an op is), `memory` (pools, addresses, poison),
`collectives` (outputs in flight), `overrun` (a short workspace), `launch` (one kernel run),
`kernels` (what the runtime declared of its kernels), `tasks` (recorded tasks, a graph's
recording), `inputs` (a replay's static inputs), `updates` (task groups and their updates), `events`
(the host handle of an event), `dispatch` (recording under the dispatcher), `runtime` (`SimRuntime`
and `SimGraph`, the protocol).
"""
from .events import SimEvent
from .runtime import SIM_KERNELS, SimGraph, SimRuntime
from .updates import SimTaskHandle

__all__ = ["SIM_KERNELS", "SimEvent", "SimGraph", "SimRuntime", "SimTaskHandle"]
