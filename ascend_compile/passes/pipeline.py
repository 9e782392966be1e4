"""The pass pipeline: one dynamo graph in; its kernel variants, bucket table and workspace plan out.

Every pass runs here, once per compile, in this order: adapt foreign attention ops, hoist metadata,
analyse input writes, assign roles, build the write-back; then the policy picks each bucket's
kernels (decode steps, and for buckets whose decode kernel is PA, mixed steps on FIA), buckets whose
choices agree share one rewritten graph (a *variant*: at most a few, whatever the bucket count),
the workspace plan covers every bucket exactly (arithmetic over each bucket's sites) and each
variant gets its workspace node. A bucket is specialised from its variant only when it is captured
(`Target.specialize`). Every stage is dumped here (`dump.py`: files and `TORCH_TRACE` artifacts).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Collection, Protocol

import torch
from torch import fx

from ..config import CompileConfig
from ..ops.kernel_policy import KernelChoice, KernelPolicy
from ..ops.tiling import FIA, MLA, PA
from . import dump
from .find_attention import adapt_attention, attention_args, attention_nodes, layer_name
from .fx_utils import clone_graph_module, example_value
from .hoist_metadata import Prologue, hoist_metadata
from .kernel_call import KernelCall, is_kernel
from .mutations import MutationFacts, analyse_mutations
from .padding import PADDING_SEQUENCES
from .providers import Binder
from .roles import GraphSignature, assign_roles
from .select_kernels import attention_layers, choose_kernels, select_kernels
from .workspaces import GraphKey, KernelSite, NeedFn, WorkspacePlan, insert_workspaces, kernel_sites, plan_workspaces
from .write_back import WriteBack, build_write_back

log = logging.getLogger("ascend_compile")

SHORT = {PA: "pa", FIA: "fia", MLA: "mla"}


class PassTarget(Protocol):
    """What the passes ask of the device they compile for (`targets.Target`)."""

    def kernel_policy(self, config: CompileConfig, dtype: torch.dtype) -> KernelPolicy: ...

    def workspace_need(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn: ...

    def check_graph(self, gm: fx.GraphModule, keys: list[GraphKey]) -> dict[str, str]: ...
    def check_kernel(self, kernel: str, layer: str) -> None: ...

    #: the kernels whose decode graph cannot serve mixed steps (`targets.Target.mixed_graph_kernels`)
    mixed_graph_kernels: frozenset[str]
    #: whether the runtime captures graphs (`targets.Target.captures_graphs`): else no piecewise graphs
    captures_graphs: bool


@dataclasses.dataclass
class Variant:
    """One rewritten graph: a kernel per attention node, serving every graph key in `keys`."""

    name: str
    kernels: tuple[str, ...]
    gm: fx.GraphModule
    keys: list[GraphKey]


@dataclasses.dataclass
class PiecewiseVariant:
    """The graph piecewise steps run (`lowering/piecewise.py`): every attention node on the kernel
    the policy picks for mixed steps of the largest piecewise size, one workspace node naming each
    size's slot; `attention` keeps each kernel node's attention call as adapted (its op, args and
    kwargs over this graph's nodes), run instead where the target refuses the kernel a step's lengths."""

    gm: fx.GraphModule
    keys: list[GraphKey]
    kernels: tuple[str, ...]
    attention: dict[str, tuple[Any, tuple, dict]]


@dataclasses.dataclass
class RewrittenGraphs:
    """Everything lowering needs from the passes."""

    original: fx.GraphModule
    signature: GraphSignature
    variants: dict[str, Variant]
    choices: dict[GraphKey, tuple[KernelChoice, ...]]  # each graph key's kernels, and why
    plan: WorkspacePlan
    buckets: tuple[int, ...]
    block_size: int
    max_blocks: int
    graph_dir: str | None
    mutations: MutationFacts
    write_back: WriteBack
    prologue: Prologue  # the hoisted metadata inputs, computed from the step's inputs
    piecewise: PiecewiseVariant | None = None
    piecewise_reason: str | None = None  # why steps no full graph serves run eagerly, not piecewise
    #: layers served eagerly (attention node name -> why: the device refused their form, `refused_layers`)
    eager_layers: dict[str, str] = dataclasses.field(default_factory=dict)
    _keys: dict[tuple[int, bool], GraphKey] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                compare=False)

    def key_for(self, bucket: int, decode: bool) -> GraphKey:
        """The graph serving a step: a bucket without a mixed graph serves its mixed steps with its decode one
        (remembered per (bucket, decode): asked on every step, and `choices` is fixed once compiled)."""
        key = self._keys.get((bucket, decode))
        if key is None:
            key = GraphKey(bucket, decode)
            key = self._keys[bucket, decode] = key if key in self.choices else GraphKey(bucket, True)
        return key

    def variant_for(self, key: GraphKey) -> Variant:
        return next(v for v in self.variants.values() if key in v.keys)

    def describe(self) -> dict[str, Any]:
        """The plan.json content the passes know (lowering adds update tables)."""
        provider = self.prologue.provider
        provided = {i.name: i.source for i in provider.inputs} if provider is not None else {}
        graphs = {}
        # each attention node's kernel call, or the node itself where its layer is served eagerly: in graph order
        calls_of = {name: [n for n in v.gm.graph.nodes if is_kernel(n) or n.name in self.eager_layers]
                    for name, v in self.variants.items()}
        for key, choices in self.choices.items():
            variant = self.variant_for(key)
            calls = calls_of[variant.name]
            graphs[str(key)] = {
                "bucket": key.bucket,
                "decode": key.decode,
                "variant": variant.name,
                "kernels": [{"node": call.name, **(KernelCall.of(call).meta.describe() if call.name not in
                                                   self.eager_layers else {"served": self.eager_layers[call.name]}),
                             "reason": choice.reason, "times_ms": choice.times_ms} for call, choice in zip(calls, choices)],
                "workspace_slot": self.plan.graph_slot[str(key)],
            }
        return {
            "buckets": list(self.buckets),
            "static_shapes": self.signature.is_static,
            "tokens": str(self.signature.tokens),
            "padding": self.signature.pad_reason or "padded to the bucket",
            "padding_sequences": PADDING_SEQUENCES,
            "symbols": {str(sym): kind.value for sym, kind in self.signature.symbol_kinds.items()},
            "input_writes": [{"input": self.signature.inputs[w.input].name, "node": w.node,
                              "padding_safe": w.padding_safe} for w in self.mutations.writes],
            "write_back": self.write_back.describe(),
            "hoisted_metadata": list(self.prologue.names),
            "provided_inputs": self.prologue.provider.describe() if self.prologue.provider else [],
            "block_size": self.block_size,
            "max_blocks": self.max_blocks,
            "inputs": [
                {"index": s.index, "name": s.name, "role": s.role.value, "mutated": s.mutated,
                 "shape": None if s.shape is None else [str(d) for d in s.shape],
                 **({"provided_by": provided[s.name]} if s.name in provided else {})}
                for s in self.signature.inputs
            ],
            "variants": {name: {"kernels": list(v.kernels), "graphs": [str(k) for k in v.keys]}
                         for name, v in self.variants.items()},
            "graphs": graphs,
            "workspace": self.plan.to_json(),
        }


def _buckets(signature: GraphSignature, config: CompileConfig) -> tuple[int, ...]:
    """The capture sizes, or the one token count of a graph dynamo traced with a static one."""
    if isinstance(signature.tokens, int):
        return (signature.tokens,)
    return config.capture_sizes


def bucket_choices(layers: list, buckets: tuple[int, ...], policy: KernelPolicy,
                   mixed_graph_kernels: frozenset[str] = frozenset({PA})) -> dict[GraphKey, tuple[KernelChoice, ...]]:
    """Each graph key's kernels: every bucket's decode steps, and the mixed steps of a bucket whose
    decode kernels include one of `mixed_graph_kernels` (the target's: PA is decode-only; on the
    simulator and NPU, FIA and MLA take another branch for one query token than for more, by torch_npu's
    docs, though not by the kernel source for TND: `targets.Target.mixed_graph_kernels`); a decode
    graph of other kernels (CUDA's FIA and MLA) serves mixed steps too."""
    choices = {}
    for bucket in buckets:
        decode = choose_kernels(layers, bucket, policy, decode=True)
        choices[GraphKey(bucket, True)] = decode
        log.debug("ascend_compile: bucket %d decode steps: %s", bucket,
                  "; ".join(sorted({c.reason for c in decode})))
        if any(c.kernel in mixed_graph_kernels for c in decode):
            choices[GraphKey(bucket, False)] = choose_kernels(layers, bucket, policy, decode=False)
    return choices


def workspace_plan(choices: dict[GraphKey, tuple[KernelChoice, ...]], sites_of: Callable[[GraphKey], list[KernelSite]],
                   config: CompileConfig, need_fn: NeedFn) -> WorkspacePlan:
    """The workspace plan of every graph key in `choices`, each key's kernel nodes `sites_of(key)`
    (the rewrite's; or, before any rewrite, its layers': `integrations/vllm/memory.py`)."""
    return plan_workspaces(((key, _sites_for(key, sites_of(key), choices)) for key in choices),
                           config.max_model_len, config.workspace_seq_len, config.share_workspace, need_fn)


def _sites_for(key: GraphKey, sites: list[KernelSite], choices: dict) -> list[KernelSite]:
    """`sites` of `key`'s graph, knowing how many query tokens its sequences may have: one in a
    decode graph whose bucket has a mixed graph of its own, else up to the bucket."""
    decode_only = key.decode and GraphKey(key.bucket, False) in choices
    return [dataclasses.replace(s, max_query_len=1 if decode_only else key.bucket) for s in sites]


def _piecewise_keys(signature: GraphSignature, config: CompileConfig) -> tuple[list[GraphKey], str | None]:
    """The piecewise graph keys, one per piecewise size (a graph traced with a static token count:
    that count, if listed), or none and why."""
    if not config.piecewise_sizes:
        return [], "piecewise_sizes is empty"
    if signature.pad_reason:
        return [], f"steps are not padded ({signature.pad_reason})"
    sizes = config.piecewise_sizes
    if isinstance(signature.tokens, int):
        sizes = tuple(s for s in sizes if s == signature.tokens)
        if not sizes:
            return [], f"the graph's token count is static ({signature.tokens}) and not a piecewise size"
    return [GraphKey(size, False, piecewise=True) for size in sizes], None


def _sizable(keys: list[GraphKey], sites: list[KernelSite], config: CompileConfig, need: NeedFn
             ) -> tuple[list[GraphKey], str | None]:
    """The piecewise keys whose every kernel node the target can size a workspace for (a kernel's
    limit, e.g. FIA's 4096 sequences a TND call, ends them: a rule of the target's, a ValueError, or the
    device's own refusal of its workspace query, which torch_npu raises as a RuntimeError), and what ended
    the others."""
    for i, key in enumerate(keys):
        try:
            for site in _sites_for(key, sites, {}):
                need(site, key.bucket, config.max_model_len, config.workspace_seq_len)
        except (ValueError, RuntimeError) as err:
            return keys[:i], f"{key.bucket} tokens and above: {err}"
    return keys, None


def _piecewise_variant(gm: fx.GraphModule, keys: list[GraphKey], kernels: tuple[str, ...],
                       eager: Collection[str] = ()) -> PiecewiseVariant:
    """`gm` with every attention node on `kernels` (but those of layers served eagerly, `eager`), keeping each
    node's call for `PiecewiseVariant.attention`."""
    piece_gm = clone_graph_module(gm)
    calls = {n.name: (n.target, n.args, dict(n.kwargs)) for n in attention_nodes(piece_gm)}
    select_kernels(piece_gm, kernels, eager)
    return PiecewiseVariant(piece_gm, list(keys), kernels, calls)


def _variant_name(kernels: tuple[str, ...], taken: dict[str, tuple[str, ...]]) -> str:
    """`pa`, `fia`, or for layers of both kernels their counts (`pa16+fia16`), made unique among
    the names `taken` by other kernel tuples."""
    kinds = sorted(set(kernels), key=lambda k: SHORT[k], reverse=True)
    name = SHORT[kinds[0]] if len(kinds) == 1 else "+".join(f"{SHORT[k]}{kernels.count(k)}" for k in kinds)
    base, n = name, 1
    while name in taken and taken[name] != kernels:
        n += 1
        name = f"{base}_{n}"
    return name


def rewrite_buckets(gm: fx.GraphModule, config: CompileConfig, target: PassTarget,
                    bind: Binder | None = None) -> RewrittenGraphs | None:
    """Run every pass over `gm`; None when the graph has no attention. `bind` (an integration's
    binder, `passes/providers.py`) first turns what the graph's ops read from outside it into
    provided inputs."""
    original, gm = gm, clone_graph_module(gm)
    provider = bind(gm) if bind is not None else None
    if not adapt_attention(gm):
        return None
    if config.max_model_len is None:
        raise ValueError(
            "max_model_len: required for graphs with paged attention (workspaces are sized for every "
            "length up to it); pass options={'max_model_len': N}"
        )
    prologue = hoist_metadata(gm, provider)
    attention = attention_nodes(gm)
    mutations = analyse_mutations(gm)
    signature = assign_roles(gm, attention, mutations)
    write_back = build_write_back(gm, signature, mutations)
    if signature.pad_reason:
        log.info("ascend_compile: steps are not padded (each size is captured as is): %s", signature.pad_reason)
    first = attention_args(attention[0])
    dtype = example_value(first.query).dtype
    block_size = int(example_value(first.key_cache).shape[1])
    max_blocks = -(-config.max_model_len // block_size)
    graph_dir = dump.new_graph_dir(config.dump_dir, config.model_name) if config.dump_dir else None
    dump.dump_graph(original, graph_dir, "original", "dynamo")
    if prologue.graph is not None:
        dump.dump_graph(prologue.graph, graph_dir, "original", "prologue")

    buckets = _buckets(signature, config)
    policy = target.kernel_policy(config, dtype)
    choices = bucket_choices(attention_layers(gm), buckets, policy, target.mixed_graph_kernels)
    pieces, piecewise_reason = _piecewise_keys(signature, config) if getattr(target, "captures_graphs", True) else (
        [], "the runtime captures no graphs")
    piece_kernels = tuple(c.kernel for c in choose_kernels(attention_layers(gm), pieces[-1].bucket, policy,
                                                           decode=False)) if pieces else ()
    for node, kernel in dict.fromkeys([*((n, c.kernel) for chosen in choices.values() for n, c in zip(attention, chosen)),
                                       *zip(attention, piece_kernels)]):
        target.check_kernel(kernel, layer_name(node))
    variants: dict[str, Variant] = {}
    variant_of: dict[GraphKey, str] = {}
    for key, chosen in choices.items():
        kernels = tuple(c.kernel for c in chosen)
        name = variant_of[key] = _variant_name(kernels, {n: v.kernels for n, v in variants.items()})
        if name not in variants:
            variant_gm = clone_graph_module(gm)
            select_kernels(variant_gm, kernels)
            variants[name] = Variant(name, kernels, variant_gm, [])
        variants[name].keys.append(key)
    eager_layers: dict[str, str] = {}
    for variant in variants.values():
        eager_layers.update(target.check_graph(variant.gm, variant.keys))
    if eager_layers:  # served eagerly (refused_layers="eager"): left as attention ops in every variant
        log.warning("ascend_compile: %d layer(s) served eagerly, between captured pieces (refused_layers='eager'): "
                    "%s", len(eager_layers), "; ".join(eager_layers.values()))
        for variant in variants.values():
            variant.gm = clone_graph_module(gm)
            select_kernels(variant.gm, variant.kernels, eager_layers)
    sites = {name: kernel_sites(variant.gm) for name, variant in variants.items()}
    # each answer kept: the piecewise keys are sized once to find those the target can size, then planned
    need = functools.cache(target.workspace_need(config, dtype))
    piecewise = None
    if pieces:
        piecewise = _piecewise_variant(gm, pieces, piece_kernels, eager_layers)
        sites["piecewise"] = kernel_sites(piecewise.gm)
        pieces, dropped = _sizable(pieces, sites["piecewise"], config, need)
        piecewise.keys = pieces
        if dropped:
            log.info("ascend_compile: no piecewise graphs for %s", dropped)
        if not pieces:
            piecewise, piecewise_reason = None, dropped
        variant_of.update((key, "piecewise") for key in pieces)
    planned = {**choices, **{key: () for key in pieces}}
    plan = workspace_plan(planned, lambda key: sites[variant_of[key]], config, need)
    for warning in plan.warnings():
        log.warning(warning)
    for variant in variants.values():
        dump.dump_graph(variant.gm, graph_dir, variant.name, "1_select_kernels")
        insert_workspaces(variant.gm, variant.keys, plan)
        variant.gm.recompile()
        dump.dump_graph(variant.gm, graph_dir, variant.name, "2_insert_workspaces")
    if piecewise is not None:
        insert_workspaces(piecewise.gm, pieces, plan)
        piecewise.gm.recompile()
        dump.dump_graph(piecewise.gm, graph_dir, "piecewise", "2_insert_workspaces")
    result = RewrittenGraphs(original, signature, variants, choices, plan, buckets, block_size, max_blocks, graph_dir,
                             mutations, write_back, prologue, piecewise, piecewise_reason, eager_layers)
    log.info(
        "ascend_compile: %d attention nodes, %d variants (%s) over buckets %s, workspace %s",
        len(attention), len(variants), ", ".join(variants), list(buckets),
        {n: s.nbytes for n, s in plan.slots.items()},
    )
    return result
