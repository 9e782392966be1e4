"""Rewrite each attention node into the kernel chosen for a bucket: PA or FIA.

The kernels take host-side lengths; the rewrite adds one host-list input per runner input it
converts (one `seq_lens` list shared by every layer), which the runner fills once per step and
lowering freezes into captured tasks. Each kernel node gets an unplanned workspace (0 bytes) that
`insert_workspaces` replaces; the choice and its reason are recorded on the node.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import fx

from ..ops import tiling
from .find_attention import AttentionArgs
from .fx_utils import example_value, is_op

#: Times one call of (kernel, shape, bucket) on the target runtime, in seconds.
KernelTimer = Callable[[str, tiling.AttentionShape, int], float]

HOST_LIST = "list"  # input.tolist()
HOST_ENDS = "ends"  # input[1:].tolist() (cumulative query ends from query_start_loc)


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How a bucket's kernel is chosen (see `CompileConfig.kernel_policy`)."""

    kind: str = "pa_max_batch"
    pa_max_batch: int = 16
    pa_batch_sizes: tuple[int, ...] = ()
    timer: KernelTimer | None = None
    timing_seq_len: int = 1024

    def __post_init__(self) -> None:
        if self.kind == "auto" and self.timer is None:
            raise ValueError("timer: the 'auto' kernel policy needs a timer to measure both kernels")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel of one attention node in one bucket, and why."""

    kernel: str
    reason: str
    times_ms: dict[str, float] | None = None


def choose_kernel(policy: KernelPolicy, bucket: int, decode: bool, shape: tiling.AttentionShape) -> KernelChoice:
    """The kernel `policy` picks for a bucket of `bucket` tokens."""
    pa, fia = tiling.PA, tiling.FIA
    if not decode:
        return KernelChoice(fia, "FIA: steps with several query tokens per sequence; PA is decode-only")
    if policy.kind == "pa":
        return KernelChoice(pa, "PA: kernel_policy='pa'")
    if policy.kind == "fia":
        return KernelChoice(fia, "FIA: kernel_policy='fia'")
    if policy.kind == "pa_max_batch":
        if bucket <= policy.pa_max_batch:
            return KernelChoice(pa, f"PA: bucket {bucket} <= pa_max_batch {policy.pa_max_batch}")
        return KernelChoice(fia, f"FIA: bucket {bucket} > pa_max_batch {policy.pa_max_batch}")
    if policy.kind == "pa_batch_sizes":
        if bucket in policy.pa_batch_sizes:
            return KernelChoice(pa, f"PA: bucket {bucket} in pa_batch_sizes {list(policy.pa_batch_sizes)}")
        return KernelChoice(fia, f"FIA: bucket {bucket} not in pa_batch_sizes {list(policy.pa_batch_sizes)}")
    if policy.kind == "auto":
        times = {k: policy.timer(k, shape, bucket) * 1e3 for k in (pa, fia)}
        best = min(times, key=times.get)
        label = "PA" if best == pa else "FIA"
        return KernelChoice(
            best,
            f"{label}: measured PA {times[pa]:.3f} ms vs FIA {times[fia]:.3f} ms "
            f"at batch {bucket}, context {policy.timing_seq_len}",
            times,
        )
    raise ValueError(f"kernel_policy: unknown policy {policy.kind!r}")


def _host_input(graph: fx.Graph, source: fx.Node, kind: str) -> fx.Node:
    """The placeholder carrying the host-side list of `source` (created once per source and kind)."""
    name = f"{source.name}_{'ends' if kind == HOST_ENDS else 'host'}"
    for node in graph.nodes:
        if node.op == "placeholder" and node.name == name:
            return node
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    node.meta["ascend_host_of"] = {"input": source.name, "kind": kind}
    return node


def select_kernels(gm: fx.GraphModule, bucket: int, policy: KernelPolicy, decode: bool = True) -> list[KernelChoice]:
    """Rewrite every `ascend.attention` node of `gm` into PA or FIA for `bucket` tokens."""
    graph = gm.graph
    choices = []
    for node in [n for n in graph.nodes if is_op(n, torch.ops.ascend.attention)]:
        args = AttentionArgs.of(node)
        query = example_value(args.query)
        shape = tiling.AttentionShape.of(query, example_value(args.key_cache))
        choice = choose_kernel(policy, bucket, decode, shape)
        seq_host = _host_input(graph, args.seq_lens, HOST_LIST)
        with graph.inserting_before(node):
            out = graph.call_function(torch.empty_like, (args.query,))
            out.meta["example_value"] = example_value(node)
            workspace = graph.call_function(torch.ops.ascend.workspace.default, (0, query.device))
            common = (args.query, args.key_cache, args.value_cache, args.block_table)
            if choice.kernel == tiling.PA:
                call = graph.call_function(
                    torch.ops.ascend.paged_attention.default,
                    (*common, seq_host, args.scale, workspace, out),
                )
                host_args = {"context_lens": (args.seq_lens.name, HOST_LIST)}
            else:
                ends_host = _host_input(graph, args.query_start_loc, HOST_ENDS)
                call = graph.call_function(
                    torch.ops.ascend.fused_infer_attention.default,
                    (*common, ends_host, seq_host, args.scale, workspace, out),
                )
                host_args = {
                    "actual_seq_lengths": (args.query_start_loc.name, HOST_ENDS),
                    "actual_seq_lengths_kv": (args.seq_lens.name, HOST_LIST),
                }
        call.meta.update(
            ascend_kernel=dataclasses.asdict(choice) | {"bucket": bucket, "decode": decode},
            ascend_shape=shape,
            ascend_host_args=host_args,
            ascend_attention=node.name,
        )
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        choices.append(choice)
    graph.lint()
    gm.recompile()
    return choices
