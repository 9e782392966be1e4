"""What runtime "npu" calls of torch_npu, and whether the installed torch_npu offers it: read once when a
runtime is made (`missing`), refused at compile time naming what is missing and the torch_npu that offers it.

The two torch_npu releases the project is bound to offer every entry, with the same op schemas and Python
signatures: 2.10.0.post4 (vLLM-Ascend's pin) and 2.14.0, read in their wheels
(`tests/fixtures/torch_npu_2_10_0_post4_schemas.txt`, `torch_npu_2_14_schemas.txt`; docs/ascend.md, "torch_npu
2.10.0.post4 and 2.14.0"). Why check at all: an older torch_npu lacks some (docs/ascend.md, Versions), and a
torch_npu whose ATB library did not load (NNAL's `libatb.so` not sourced) registers no `atb` op while still
offering `torch_npu._npu_paged_attention` as a wrapper that fails when called
(`torch_npu/op_plugin/atb/_atb_ops.py`). Unchecked, the first call of what is missing would fail at the compile's
workspace query or in a warm-up, as an AttributeError or ATB's own error; checked, the compile refuses it first,
saying what to install.

The graph API is needed by every graph: a runtime lacking any of it is refused when it is made
(`NpuRuntime.__init__`). A kernel's functions are needed only by graphs holding that kernel: refused by
`NpuTarget.check_graph` naming the node. `torch.npu.get_stream_limit` / `set_stream_limit` are not required:
without them graphs are captured and updated on the streams' own cores (`NpuRuntime.stream_limit`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection, Iterable

import torch

from ...errors import AscendCompileError
from .. import tiling

#: Where each function was first offered, as far as docs/ascend.md's Versions table determines it.
TASK_GROUPS = "torch_npu's *-7.0.0 release lines (2.1.0.post12, 2.3.1.post6, 2.4.0.post4, 2.5.1) with CANN 8.1.RC1"
WEAK_REF = "torch_npu's *-7.1.0 release lines with CANN 8.2.RC1"
PA_WORKSPACE = "torch_npu v2.x-7.2.0 (op-plugin 7.2.0) with CANN 8.3.RC1"
READ = "torch_npu 2.10.0.post4 and 2.14.0 (the first release offering it was not determined)"
#: Why an `atb` op may be missing though the torch_npu release has it.
ATB_HINT = ("torch_npu registers the atb ops from torch_npu/lib/libop_plugin_atb.so only when NNAL's libatb.so "
            "loads: source NNAL's set_env.sh")


@dataclasses.dataclass(frozen=True)
class Api:
    """One function runtime "npu" calls, `owner.name` (owner "torch_npu", "torch_npu._C" or "torch.npu"), and for
    a kernel the op overload (`ns::name.overload`) that must be registered with a schema taking `keyword`;
    `since`: the torch_npu that offers it."""

    owner: str
    name: str
    since: str
    op: str | None = None
    keyword: str | None = None

    def __str__(self) -> str:
        call = f"{self.owner}.{self.name}"
        return f"{call}(..., {self.keyword}=)" if self.keyword else call


def _npu(name: str, since: str = READ) -> Api:
    return Api("torch.npu", name, since)


#: The graph API every graph needs (`runtime/npu.py`): capture, task groups and updates, events, streams, the
#: allocators emptied before the first capture, the generators kept around set-up work, weak aliases.
GRAPH_API: tuple[Api, ...] = (
    *(_npu(name) for name in ("NPUGraph", "graph_pool_handle", "Stream", "Event", "stream", "current_stream",
                              "current_device", "synchronize", "empty_cache", "host_empty_cache", "get_rng_state",
                              "set_rng_state")),
    *(_npu(name, TASK_GROUPS) for name in ("graph_task_group_begin", "graph_task_group_end",
                                           "graph_task_update_begin", "graph_task_update_end", "ExternalEvent")),
    Api("torch_npu._C", "_weak_ref_tensor", WEAK_REF),
)

PA_API = (
    Api("torch_npu", "_npu_paged_attention", PA_WORKSPACE, "atb::_npu_paged_attention.default", "workspace"),
    Api("torch_npu", "_npu_paged_attention_get_workspace", PA_WORKSPACE,
        "atb::_npu_paged_attention_get_workspace.default"),
)
FIA_API = (
    Api("torch_npu", "npu_fused_infer_attention_score", READ, "npu::npu_fused_infer_attention_score.out", "workspace"),
    Api("torch_npu", "_npu_fused_infer_attention_score_get_max_workspace", READ,
        "npu::_npu_fused_infer_attention_score_get_max_workspace.default"),
)
#: FIA v2: MLA's kernel and a layer with sinks (`learnable_sink`).
FIA_V2_API = (
    Api("torch_npu", "npu_fused_infer_attention_score_v2", READ, "npu::npu_fused_infer_attention_score_v2.out",
        "workspace"),
    Api("torch_npu", "_npu_fused_infer_attention_score_v2_get_max_workspace", READ,
        "npu::_npu_fused_infer_attention_score_v2_get_max_workspace.default"),
)
CACHE_WRITE_API = (Api("torch_npu", "npu_scatter_pa_kv_cache", READ, "npu::npu_scatter_pa_kv_cache.default"),)
ALL_API = GRAPH_API + PA_API + FIA_API + FIA_V2_API + CACHE_WRITE_API


def kernel_api(kernel: str, sinks: bool) -> tuple[Api, ...]:
    """The functions an `ascend` kernel node's binding calls (`ops/npu/kernels.py`): PA's, FIA's (v2's for a layer with
    sinks) or MLA's (FIA v2)."""
    if kernel == tiling.PA:
        return PA_API
    if kernel == tiling.MLA or sinks:
        return FIA_V2_API
    return FIA_API


def missing(torch_npu: Any, npu: Any, apis: Iterable[Api] = ALL_API, ops: Any = torch.ops) -> frozenset[Api]:
    """Which of `apis` the installed torch_npu (`torch_npu`, its `torch.npu` module `npu`, torch's op registry
    `ops`) does not offer: a missing attribute, an op overload not registered, or one whose schema lacks the
    keyword."""
    owners = {"torch_npu": torch_npu, "torch_npu._C": getattr(torch_npu, "_C", None), "torch.npu": npu}
    return frozenset(api for api in apis if not hasattr(owners[api.owner], api.name) or not _registered(api, ops))


def _registered(api: Api, ops: Any) -> bool:
    """Whether `api`'s op overload is registered (with a schema taking its keyword); True for a plain function."""
    if api.op is None:
        return True
    ns, qualified = api.op.split("::")
    name, overload = qualified.split(".")
    try:
        schema = getattr(getattr(getattr(ops, ns), name), overload)._schema
    except (AttributeError, RuntimeError):
        return False
    return api.keyword is None or any(a.name == api.keyword for a in schema.arguments)


def refusal(needed: Iterable[Api], absent: Collection[Api], version: str) -> str | None:
    """Why the installed torch_npu (`version`) cannot serve what needs `needed`, or None where it offers all."""
    lacking = [api for api in needed if api in absent]
    if not lacking:
        return None
    parts = []
    for api in lacking:
        hint = f"; {ATB_HINT}" if api.op is not None and api.op.startswith("atb::") else ""
        parts.append(f"{api} (offered by {api.since}{hint})")
    return f"torch_npu {version} does not offer {'; '.join(parts)}"


def require(needed: Iterable[Api], absent: Collection[Api], version: str, what: str) -> None:
    """Refuse `what` (a runtime, a graph's node) where the installed torch_npu lacks any of `needed`."""
    why = refusal(needed, absent, version)
    if why:
        raise AscendCompileError(f"{what}: {why}")
