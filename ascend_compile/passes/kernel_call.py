"""The kernel-call contract: a typed view of a PA/FIA/MLA node and the metadata it carries.

`select_kernels` writes a `KernelMeta` on every kernel node it creates; workspaces, device lengths,
torchair, capture and the runner only read it. Arguments are named by the ops' own schemas, so no
other module knows a kernel argument's position, and a kernel node says by `HostArg` which of its
arguments are host lengths, where each comes from (a runner input, or a provider's field) and how
it is converted — the whole path of `seq_lens` from a step to a kernel is spelled out here.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from ..ops import tiling
from ..ops.features import PLAIN, AttentionFeatures
from .fx_utils import is_op

#: The host-length kernel op of each kernel name, and its device-length form (CUDA graphs).
HOST_LENGTH_OPS = {tiling.PA: torch.ops.ascend.paged_attention.default,
                   tiling.FIA: torch.ops.ascend.fused_infer_attention.default,
                   tiling.MLA: torch.ops.ascend.mla_fused_infer_attention.default}
DEVICE_LENGTH_OPS = {tiling.PA: torch.ops.ascend.paged_attention_dev.default,
                     tiling.FIA: torch.ops.ascend.fused_infer_attention_dev.default,
                     tiling.MLA: torch.ops.ascend.mla_fused_infer_attention_dev.default}
KERNEL_PACKETS = tuple(op.overloadpacket for op in (*HOST_LENGTH_OPS.values(), *DEVICE_LENGTH_OPS.values()))

#: The device input each host-length argument reads on CUDA.
DEVICE_LENGTH_ARGS = {"context_lens": "seq_lens", "actual_seq_lengths": "query_start_loc",
                      "actual_seq_lengths_kv": "seq_lens", "actual_seq_qlen": "query_start_loc",
                      "actual_seq_kvlen": "seq_lens"}

META_KEY = "ascend_call"  # fx.Node.meta key of a kernel node's `KernelMeta`
HOST_META_KEY = "ascend_host"  # fx.Node.meta key of a host-list placeholder's `HostSource`


class Conversion(str, enum.Enum):
    """How a host-length argument is derived from the tensor it comes from."""

    LIST = "list"  # tensor.tolist(): per-sequence KV lengths
    ENDS = "ends"  # tensor[1:].tolist(): cumulative query ends from query_start_loc


#: Each kernel's host-length arguments: the attention op's argument each comes from, and how.
#: Every other argument of a kernel named like one of the attention op's takes that one's value.
HOST_LENGTH_ARGS = {
    tiling.PA: {"context_lens": ("seq_lens", Conversion.LIST)},
    tiling.FIA: {"actual_seq_lengths": ("query_start_loc", Conversion.ENDS),
                 "actual_seq_lengths_kv": ("seq_lens", Conversion.LIST)},
    tiling.MLA: {"actual_seq_qlen": ("query_start_loc", Conversion.ENDS),
                 "actual_seq_kvlen": ("seq_lens", Conversion.LIST)},
}


@dataclasses.dataclass(frozen=True)
class HostSource:
    """Where a host list comes from: a runner input (or provider field) by name, and its conversion."""

    source: str
    conversion: Conversion

    def placeholder_name(self) -> str:
        return f"{self.source}_{'ends' if self.conversion is Conversion.ENDS else 'host'}"


#: Why a step may not run on a graph (it then runs eagerly), or None: given the step's padded host
#: lists, as the graph's kernels would take them (`Target.step_guard`).
StepGuard = Callable[[Mapping[HostSource, list[int]], Sequence[Any]], "str | None"]


@dataclasses.dataclass(frozen=True)
class HostArg:
    """One host-length argument of a kernel: the argument's name and where its value comes from."""

    kernel_arg: str
    source: HostSource


@dataclasses.dataclass(frozen=True)
class KernelMeta:
    """What the compiler decided for one kernel node."""

    kernel: str  # tiling.PA, tiling.FIA or tiling.MLA
    attention: str  # the attention node it replaces
    shape: tiling.AttentionShape
    host_args: tuple[HostArg, ...]
    lengths: str = "host"  # "host" (frozen at capture, refreshed by task updates) or "device"
    num_splits: int | None = None  # the device-length kernels' split count
    features: AttentionFeatures = PLAIN  # the layer's window, soft-cap, sinks

    def describe(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "attention": self.attention,
            "lengths": self.lengths,
            **({"features": self.features.describe()} if not self.features.plain else {}),
            **({"num_splits": self.num_splits} if self.num_splits is not None else {}),
            "host_args": {a.kernel_arg: {"input": a.source.source, "conversion": a.source.conversion.value}
                          for a in self.host_args},
        }


@functools.cache
def arg_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The argument names of a kernel op, from its schema."""
    return tuple(a.name for a in op._schema.arguments)


def build_args(op: torch._ops.OpOverload, values: Mapping[str, Any]) -> tuple[Any, ...]:
    """The positional arguments of `op` from named values (every argument named once)."""
    names = arg_names(op)
    missing, extra = set(names) - set(values), set(values) - set(names)
    if missing or extra:
        raise ValueError(f"{op}: expected arguments {list(names)}, missing {sorted(missing)}, unknown {sorted(extra)}")
    return tuple(values[n] for n in names)


def with_host_lengths(op: torch._ops.OpOverload, args: Sequence[Any], lengths: Mapping[str, Any]) -> list[Any]:
    """`args` of `op` with the named host-length arguments replaced (a task update's arguments)."""
    names = arg_names(op)
    out = list(args)
    for name, value in lengths.items():
        out[names.index(name)] = value
    return out


def is_kernel(node: fx.Node) -> bool:
    """Whether `node` is a PA/FIA/MLA kernel call (host- or device-length)."""
    return node.op == "call_function" and any(is_op(node, p) for p in KERNEL_PACKETS)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """A kernel node with its arguments by name and its `KernelMeta`."""

    node: fx.Node
    meta: KernelMeta

    @classmethod
    def of(cls, node: fx.Node) -> "KernelCall":
        if not is_kernel(node) or META_KEY not in node.meta:
            raise ValueError(f"{node.name}: not a kernel node made by select_kernels")
        return cls(node, node.meta[META_KEY])

    @property
    def op(self) -> torch._ops.OpOverload:
        return self.node.target

    def arg(self, name: str) -> Any:
        return self.node.args[arg_names(self.op).index(name)]

    def args(self) -> dict[str, Any]:
        return dict(zip(arg_names(self.op), self.node.args))

    @property
    def workspace(self) -> fx.Node:
        return self.arg("workspace")

    def set_workspace(self, workspace: fx.Node) -> None:
        self.node.update_arg(arg_names(self.op).index("workspace"), workspace)

    def host_lengths(self, args: Sequence[Any]) -> dict[str, list[int]]:
        """The host-length arguments among `args` (this kernel's evaluated arguments), by name."""
        names = arg_names(self.op)
        return {a.kernel_arg: list(args[names.index(a.kernel_arg)]) for a in self.meta.host_args}


def kernel_calls(gm: fx.GraphModule) -> list[KernelCall]:
    """Every kernel node of a graph rewritten by `select_kernels`, in graph order."""
    return [KernelCall.of(n) for n in gm.graph.nodes if is_kernel(n)]


def host_placeholders(gm: fx.GraphModule) -> list[tuple[fx.Node, HostSource]]:
    """The host-list placeholders `select_kernels` added, with their sources, in argument order."""
    return [(n, n.meta[HOST_META_KEY]) for n in gm.graph.nodes if n.op == "placeholder" and HOST_META_KEY in n.meta]


def host_sources(gm: fx.GraphModule) -> list[HostSource]:
    return [source for _, source in host_placeholders(gm)]

