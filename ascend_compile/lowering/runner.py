"""The runner: what `torch.compile` calls each step.

Per call: read the step (one host conversion per length input), pick the bucket and its graph
(decode or mixed), copy the inputs into the graph's static buffers padded by role, launch the
replay, apply the update table, synchronize, unpad and (by default) clone the outputs. Steps larger
than every bucket run the original graph eagerly. Parameters, buffers and KV caches are used in
place; their addresses are checked every step and a graph whose inputs moved is re-captured.
Host scalars (0-d CPU tensors, e.g. dynamo's wrapped floats) are read at capture like any host
argument, so their values are checked every step too.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Sequence

import torch
from torch import fx

from ..config import CompileConfig
from ..passes import dump
from ..passes.fx_utils import is_op
from ..passes.pipeline import RewrittenGraphs
from ..passes.roles import IN_PLACE_ROLES, PAD_VALUE, GraphSignature, Role, SymbolKind, evaluate
from ..passes.write_back import copy_written, overlapping_writes
from ..passes.workspaces import GraphKey
from ..runtime.base import Runtime
from . import capture as capture_mod
from .inputs import (PA_CAPTURE_SEQ_LEN, Step, capture_step, choose_bucket, copy_padded, host_value, overlapping_inputs,
                     padded_shape, padded_start_loc, read_step)

log = logging.getLogger("ascend_compile")


def _host_inputs(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(runner input, conversion) of each host-list placeholder a bucket graph appends."""
    return [
        (n.meta["ascend_host_of"]["input"], n.meta["ascend_host_of"]["kind"])
        for n in gm.graph.nodes
        if n.op == "placeholder" and "ascend_host_of" in n.meta
    ]


def _unpad(outputs: Any, shapes: Sequence[Any], symbols: dict, clone: bool) -> tuple:
    result = []
    for out, shape in zip(outputs, shapes):
        if isinstance(out, torch.Tensor) and shape is not None:
            actual = [evaluate(d, symbols) for d in shape]
            view = out
            for dim, n in enumerate(actual):
                if view.shape[dim] != n:
                    view = view.narrow(dim, 0, n)
            out = view.clone() if clone else view
        result.append(out)
    return tuple(result)


def _specialization(signature: GraphSignature, symbols: dict) -> tuple[tuple[str, int], ...]:
    """The values of the graph's specialized symbols in a step: part of the key of its capture."""
    return tuple((str(sym), symbols[sym]) for sym in signature.specialized)


class BucketGraph:
    """One captured graph: its static buffers, device graph, outputs and update table.

    It serves one graph key and one value of each specialized symbol (`specialization`)."""

    def __init__(self, artifact: "CompiledArtifact", key: GraphKey, symbols: dict) -> None:
        self.artifact = artifact
        self.key = key
        self.gm = artifact.rewritten.graphs[key]
        self.host_inputs = _host_inputs(self.gm)
        sig = artifact.signature
        self.specialization = _specialization(sig, symbols)
        self.padded = sig.padded_symbols(key.bucket, artifact.rewritten.max_blocks, symbols)
        self.num_tokens = evaluate(sig.tokens, self.padded)
        self.num_seqs = evaluate(sig.sequences, self.padded)
        runtime = artifact.runtime
        self.buffers: dict[int, torch.Tensor] = {}
        for spec in sig.inputs:
            if spec.copied:
                dtype = self.gm.graph.find_nodes(op="placeholder")[spec.index].meta["example_value"].dtype
                self.buffers[spec.index] = runtime.empty(padded_shape(spec, self.padded), dtype)
        for sym, kind in sig.symbol_kinds.items():
            if kind is SymbolKind.LAYOUT:
                source = sig.symbol_sources[sym]
                self.padded[sym] = source.read(self.buffers[source.index])
        self.graph = None
        self.outputs = None
        self.written_views: list[torch.Tensor] = []
        self.eager_reason: str | None = None  # why this graph cannot serve steps exactly, found at capture
        self.table: capture_mod.UpdateTable | None = None
        self.addresses: dict[int, int] = {}
        self.scalars: dict[int, Any] = {}
        self.capture_seconds = 0.0

    @property
    def name(self) -> str:
        """The graph key, with the specialized sizes it was captured for."""
        return str(self.key) + "".join(f"[{s}={v}]" for s, v in self.specialization)

    def graph_args(self, step_args: Sequence[Any]) -> list[Any]:
        """Arguments of the bucket graph: static buffers, in-place inputs, padded symbols."""
        args = []
        for spec in self.artifact.signature.inputs:
            if spec.index in self.buffers:
                args.append(self.buffers[spec.index])
            elif spec.role is Role.SYMINT:
                args.append(evaluate(spec.expr, self.padded))
            else:
                args.append(step_args[spec.index])
        return args

    def capture(self, step_args: Sequence[Any]) -> None:
        """Capture with an all-padding step in the buffers (nothing depends on capture-time values),
        its kernels given non-zero KV lengths (`_capture_seq_len`)."""
        art = self.artifact
        start = time.perf_counter()
        for spec in art.signature.inputs:
            if spec.index in self.buffers:
                buf = self.buffers[spec.index]
                if spec.role is Role.QUERY_START_LOC:
                    buf.copy_(torch.tensor(padded_start_loc([0], 0, self.num_tokens, self.num_seqs), dtype=buf.dtype))
                else:
                    buf.fill_(PAD_VALUE.get(spec.role, 0))
        empty = capture_step([src for src, _ in self.host_inputs], self.num_seqs, self._capture_seq_len())
        host = [host_value(empty, src, kind, self.num_tokens, self.num_seqs) for src, kind in self.host_inputs]
        graph_args = self.graph_args(step_args)
        # Capture runs the graph once; inputs it writes in place get their contents back after it.
        unsafe = {w.input for w in art.rewritten.mutations.unsafe()}
        saved = {i: step_args[i].clone() for i in unsafe if not art.signature.inputs[i].copied}
        self.graph, outputs, self.table = capture_mod.capture_graph(self.gm, art.runtime, graph_args + host, art.workspace_for)
        for i, contents in saved.items():
            step_args[i].copy_(contents)
        self.outputs = outputs
        self.locate_writes(graph_args)
        self.addresses = {
            spec.index: step_args[spec.index].data_ptr()
            for spec in art.signature.inputs
            if spec.role in IN_PLACE_ROLES and isinstance(step_args[spec.index], torch.Tensor)
        }
        self.scalars = {spec.index: step_args[spec.index].item() for spec in art.signature.by_role(Role.SCALAR)}
        self.capture_seconds = time.perf_counter() - start
        art.stats["captures"] += 1
        log.info("ascend_compile: captured %s%s in %.3f s (%d update entries)", self.key,
                 "".join(f" {s}={v}" for s, v in self.specialization), self.capture_seconds, len(self.table.entries))

    def locate_writes(self, graph_args: Sequence[Any]) -> None:
        """Where the graph writes its copied inputs, in the static buffers (fixed for the graph's
        life); writes that overlap there cannot be copied back exactly, so the graph serves no step."""
        write_back = self.artifact.rewritten.write_back
        self.written_views = write_back.views(graph_args)[0]
        clashes = overlapping_writes(self.written_views, write_back.located)
        if clashes:
            names = [self.artifact.signature.inputs[i].name for i in clashes]
            self.eager_reason = f"{self.name}: inputs {names} are written twice at overlapping places in the padded graph"

    def _capture_seq_len(self) -> int | None:
        """The KV length a decode graph with PA is captured at, within what its block table holds
        (never 0: a kernel's zero-length fast path would record another task than its updates
        issue); None for padding lengths."""
        pa = [n for n in self.gm.graph.nodes if is_op(n, torch.ops.ascend.paged_attention)]
        if not self.key.decode or not pa:
            return None
        sig = self.artifact.signature
        widths = [self.buffers[s.index].shape[-1] for s in sig.by_role(Role.BLOCK_TABLE) if s.index in self.buffers]
        capacity = min(widths, default=PA_CAPTURE_SEQ_LEN) * pa[0].meta["ascend_shape"].block_size
        return min(PA_CAPTURE_SEQ_LEN, capacity, self.artifact.config.max_model_len or PA_CAPTURE_SEQ_LEN)

    def moved_inputs(self, step_args: Sequence[Any]) -> list[str]:
        """In-place inputs at another address, and host scalars of another value, than at capture."""
        names = {s.index: s.name for s in self.artifact.signature.inputs}
        moved = [names[i] for i, ptr in self.addresses.items() if step_args[i].data_ptr() != ptr]
        return moved + [names[i] for i, v in self.scalars.items() if step_args[i].item() != v]

    def copy_in(self, step: Step) -> None:
        """The step's inputs into the static buffers, padded by role."""
        for spec in self.artifact.signature.inputs:
            if spec.index in self.buffers:
                copy_padded(spec, step.args[spec.index], self.buffers[spec.index], step, self.num_tokens)

    def copy_back(self, step: Step) -> dict[int, torch.Tensor]:
        """Exactly what the graph wrote into copied inputs, into the caller's tensors; returns, by
        output position, the outputs that are views of copied inputs, as views of the caller's."""
        write_back = self.artifact.rewritten.write_back
        written, aliased = write_back.views(step.args)
        for dest, src in zip(written, self.written_views):
            copy_written(dest, src)
        for index in write_back.whole:
            copy_written(step.args[index], self.buffers[index])
        return dict(zip(write_back.outputs, aliased))

    def run(self, step: Step) -> Any:
        art = self.artifact
        seconds = art.seconds
        t0 = time.perf_counter()
        self.copy_in(step)
        t1 = time.perf_counter()
        self.graph.replay()
        art.stats["updates"] += self.table.apply(art.runtime, lambda src, kind: step.host[(src, kind)])
        t2 = time.perf_counter()
        art.runtime.synchronize()
        t3 = time.perf_counter()
        seconds["copy_in"] += t1 - t0
        seconds["launch_and_updates"] += t2 - t1
        seconds["synchronize"] += t3 - t2
        art.stats["replays"] += 1
        return self.outputs

    def run_eager(self, step: Step) -> Any:
        """Run the bucket graph directly (a runtime without graphs), workspaces from the artifact."""
        art = self.artifact
        self.copy_in(step)
        host = [step.host[(src, kind)] for src, kind in self.host_inputs]
        env = capture_mod.workspace_env(self.gm, art.workspace_for)
        return fx.Interpreter(self.gm).run(*self.graph_args(step.args), *host, initial_env=env)

    def memory(self) -> dict[str, int]:
        static = sum(b.numel() * b.element_size() for b in self.buffers.values())
        outs = sum(o.numel() * o.element_size() for o in (self.outputs or ()) if isinstance(o, torch.Tensor))
        return {"static_inputs_bytes": static, "outputs_bytes": outs}


class CompiledArtifact:
    """The callable dynamo runs in place of the graph; owns graphs, buffers and workspace slots."""

    def __init__(self, rewritten: RewrittenGraphs, runtime: Runtime, config: CompileConfig) -> None:
        self.rewritten = rewritten
        self.signature: GraphSignature = rewritten.signature
        self.runtime = runtime
        self.config = config
        self.lock = threading.Lock()
        self.graphs: dict[tuple[GraphKey, tuple], BucketGraph] = {}
        self.workspaces: dict[str, torch.Tensor] = {}
        self.stats: collections.Counter = collections.Counter()
        #: Seconds spent per phase of graph steps: copy_in, launch_and_updates, synchronize (the
        #: device work, or on the simulator its execution), host (the rest of the runner's step).
        self.seconds: collections.Counter = collections.Counter()
        self._fallbacks_logged: set[str] = set()
        self.written = self.rewritten.mutations.written()
        self.copied = {spec.index for spec in self.signature.inputs if spec.copied}
        for slot in rewritten.plan.slots.values():
            self.workspaces[slot.name] = runtime.empty((slot.nbytes,), torch.uint8)
        self.write_plan()

    def workspace_for(self, node: fx.Node) -> torch.Tensor:
        """The artifact-owned tensor of the slot a workspace node stands for."""
        return self.workspaces[node.meta["ascend_workspace_slot"]["name"]]

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            start = time.perf_counter()
            phases = sum(self.seconds.values())
            result = self._step(self.rewritten.prologue.extend(args), args)
            self.seconds["host"] += time.perf_counter() - start - (sum(self.seconds.values()) - phases)
            return result

    def _step(self, args: Sequence[Any], caller_args: Sequence[Any]) -> Any:
        """One step: `args` are the graph's inputs (the caller's, then any hoisted metadata)."""
        max_len = self.config.max_model_len
        step = read_step(self.signature, args, max_len)
        self.stats["steps"] += 1
        self.stats["host_conversions"] += len(step.seq_lens) + len(step.query_start_loc)
        bucket = choose_bucket(self.rewritten.buckets, step.tokens)
        if bucket is None:
            return self._fallback(caller_args, step, f"no graph for {step.tokens} tokens (buckets {list(self.rewritten.buckets)})")
        overlap = overlapping_inputs(self.signature, self.rewritten.mutations.alias_groups, self.written, self.copied,
                                     args)
        if overlap:
            return self._fallback(caller_args, step, f"inputs {overlap} overlap in memory and the graph writes one of them")
        key = self.rewritten.key_for(bucket, step.decode)
        graph = self._graph(key, args, step.symbols)
        if graph is None:
            return self._fallback(caller_args, step, f"{key} already has {self.config.max_specializations} captures "
                                              f"for other values of {[str(s) for s in self.signature.specialized]}")
        if graph.eager_reason:
            return self._fallback(caller_args, step, graph.eager_reason)
        step.host = {(src, kind): host_value(step, src, kind, graph.num_tokens, graph.num_seqs)
                     for src, kind in graph.host_inputs}
        if self.runtime.supports_graphs:
            outputs, clone = graph.run(step), self.config.clone_outputs
        else:
            outputs, clone = graph.run_eager(step), False
        aliased = graph.copy_back(step)
        result = _unpad(outputs, self.signature.outputs, step.symbols, clone=clone)
        return tuple(aliased.get(i, out) for i, out in enumerate(result))

    def _graph(self, key: GraphKey, args: Sequence[Any], symbols: dict) -> BucketGraph | None:
        """The graph serving `key` at these symbol values, captured if new; None when the key has
        used up its captures for other values of the specialized symbols."""
        specialization = _specialization(self.signature, symbols)
        graph = self.graphs.get((key, specialization))
        if graph is None:
            if sum(1 for k, _ in self.graphs if k == key) >= self.config.max_specializations:
                return None
            if specialization:
                log.info("ascend_compile: %s: new value %s of the specialized sizes: capturing it", key,
                         ", ".join(f"{s}={v}" for s, v in specialization))
            graph = self.graphs[(key, specialization)] = BucketGraph(self, key, symbols)
        if not self.runtime.supports_graphs:
            if not graph.written_views and self.rewritten.write_back.located:
                graph.locate_writes(graph.graph_args(args))
            return graph
        if graph.graph is not None:
            moved = graph.moved_inputs(args)
            if moved:
                log.warning("ascend_compile: inputs %s moved since %s was captured: re-capturing", moved, key)
                self.stats["recaptures"] += 1
                graph = self.graphs[(key, specialization)] = BucketGraph(self, key, symbols)
        if graph.graph is None:
            if self.config.capture_all and self.stats["captures"] == 0:
                self.capture_all(args, symbols)
            else:
                graph.capture(args)
            self.write_plan()
        return self.graphs[(key, specialization)]

    def capture_all(self, args: Sequence[Any], symbols: dict) -> None:
        """Capture every bucket's decode graph now (with a progress bar when tqdm is installed),
        at the specialized sizes of `symbols`."""
        keys = [k for k in self.rewritten.graphs if k.decode]
        try:
            from tqdm import tqdm

            keys = tqdm(keys, desc="ascend_compile capture", unit="graph", mininterval=1.0, delay=1.0)
        except ImportError:
            pass
        specialization = _specialization(self.signature, symbols)
        for key in keys:
            graph = self.graphs.get((key, specialization)) or BucketGraph(self, key, symbols)
            self.graphs[(key, specialization)] = graph
            if graph.graph is None:
                graph.capture(args)

    def _fallback(self, args: Sequence[Any], step: Step, why: str) -> Any:
        if why not in self._fallbacks_logged:
            log.info("ascend_compile: %s: running eagerly", why)
            self._fallbacks_logged.add(why)
        self.stats["eager_fallbacks"] += 1
        return self.rewritten.original(*args)

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by this artifact: workspace slots, static buffers and outputs per graph, pool."""
        report = {
            "workspace_bytes": {name: t.numel() for name, t in self.workspaces.items()},
            "graphs": {g.name: g.memory() for g in self.graphs.values() if g.graph is not None},
        }
        stats = getattr(self.runtime, "memory_stats", None)
        if stats is not None:
            report["pool"] = stats()
        return report

    def describe(self) -> dict[str, Any]:
        plan = self.rewritten.describe()
        plan["runtime"] = self.runtime.describe()
        plan["config"] = {k: v for k, v in vars(self.config).items()}
        for (key, specialization), graph in self.graphs.items():
            if graph.table is None:
                continue
            entry = plan["graphs"][str(key)]
            capture = {"update_table": graph.table.describe(), "capture_seconds": round(graph.capture_seconds, 4)}
            if specialization:
                entry.setdefault("specializations", {})[graph.name] = capture
            if not specialization or "update_table" not in entry:
                entry.update(capture)
        return plan

    def write_plan(self) -> None:
        dump.dump_plan(self.rewritten.graph_dir, self.describe())
