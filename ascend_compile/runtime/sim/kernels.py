"""What the ACL-graph simulator knows of a device's kernels: which ops are kernels, and their quirks.

A device graph holds kernel launches, never Python: an op is one task only where the device has a
kernel for it. torch's own ops are kernels of every device's operator library; beyond them a
runtime declares what it binds to a kernel of its device (`DeviceKernels(names)`: op namespaces
such as torch_npu's "atb" and "npu", or qualified op names such as "ascend::paged_attention").
Every other op, Python custom ops included, is recorded as the ops its body issues
(`dispatch.CaptureMode`), so a host read inside it fails at capture, as on the device, and a replay
runs none of its Python.

Some kernels also launch other work depending on their host arguments (a zero-length fast path, a
branch chosen by the query lengths), and
some take host tensors, which the device copies when the call is issued; a runtime declares these
per op packet. Capture and task updates then name tasks (`task_kind`) and freeze operands the same
way, which is what lets a task update be matched against the group it replaces.
"""
from __future__ import annotations

from typing import Any, Iterable

from ...errors import CaptureError
from .classify import all_zero, arg, one_query_token_each

#: torch's own op namespaces: the device's operator library implements each of their ops as a
#: kernel (ATen through torch_npu's op-plugin on Ascend; the functional collectives and c10d's own
#: collectives, `dist.all_reduce`'s `c10d.allreduce_`, through HCCL or NCCL, which launch on the
#: current stream and are captured as one task each: NCCL's "Using NCCL with CUDA Graphs" and HCCL's
#: "Integration with Mainstream Frameworks", CANN 9.0.0, graph-capture mode; docs/tensor_parallel.md
#: quotes both). A Python custom op wrapping `dist.all_reduce`
#: (vLLM's `torch.ops.vllm.all_reduce`) is therefore recorded as its collective, and a replay
#: reduces again. A model: every ATen op is taken to have a capturable kernel; on Ascend an op served
#: by the older aclop path is not ("Cannot run aclop operators during NPU graph capture",
#: libtorch_npu.so), which the simulator cannot tell.
TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d"})


class DeviceKernels:
    """The kernels of a simulated device: torch's ops and `names` (namespaces or qualified op
    names), with the facts a runtime declared of them (zero-length fast paths, host tensor inputs)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self.fast_paths: dict[Any, str] = {}
        self.query_branches: dict[Any, str] = {}
        self.host_inputs: dict[Any, tuple[str, ...]] = {}
        self.set_up: set[str] = set()

    def first_call(self, name: str, capturing: str | None) -> None:
        """Called by a kernel each time it runs (`capturing`: the graph being captured, if any): its
        first call sets it up (tiling caches, binaries, allocations), which a device cannot do inside
        a capture, so a first call during a capture raises. Run the work once eagerly before
        capturing (`DeviceGraph.warmup`).

        A model, kept because every proven capture path warms up first: torch_npu's
        `make_graphed_callables` runs warm-up iterations between synchronizes (`npu/graphs.py`), and
        vLLM-Ascend runs eager dummy steps before each capture (`model_runner_v1.py`, `_dummy_run`);
        what an unwarmed first call does inside a capture is documented nowhere."""
        if name in self.set_up:
            return
        if capturing is not None:
            raise CaptureError(
                f"{name}: first call inside the capture of {capturing}; the op sets itself up on its "
                f"first call, which the device cannot do while capturing: run it eagerly before capturing"
            )
        self.set_up.add(name)

    def is_kernel(self, op: Any) -> bool:
        """Whether `op` (an op overload) is one device kernel: recorded as one task and run as it is."""
        return op.namespace in TORCH_NAMESPACES or op.namespace in self.names or op._schema.name in self.names

    def task_kind(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The kind of task a call of `op` launches: its name, marked when its zero-length fast path
        is taken, and marked by the branch its query lengths select where it has two."""
        kind = str(op)
        ends = self.query_branches.get(op.overloadpacket)
        if ends is not None:
            kind += "[S=1]" if one_query_token_each(arg(op, args, kwargs, ends)[1]) else "[S>1]"
        lengths = self.fast_paths.get(op.overloadpacket)
        if lengths is not None and all_zero(arg(op, args, kwargs, lengths)[1]):
            return f"{kind}[all lengths 0]"
        return kind

    def host_input_args(self, op: Any) -> tuple[str, ...]:
        """The arguments of `op` that are host tensors, copied when a call is issued."""
        return self.host_inputs.get(op.overloadpacket, ())
