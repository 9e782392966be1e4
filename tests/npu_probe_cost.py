"""What the NPU target's compile-time workspace sizing costs, measured on the fake torch_npu.

`probe_cost` plans the workspaces of a model with the default buckets and kernel policy the way
`passes/pipeline.py` does (every graph key, one kernel site per layer) through `NpuTarget`'s
`workspace_need`, and counts the device memory allocated meanwhile (`fake_torch_npu.AllocatedBytes`:
probe tensors and the workspace tensors the queries answer with) and the workspace queries asked.
Used by `tests/test_npu_device.py` and `benchmarks/npu_probe_memory.py`.
"""
from __future__ import annotations

import dataclasses

import torch

from ascend_compile.config import CompileConfig
from ascend_compile.ops import tiling
from ascend_compile.ops.features import PLAIN
from ascend_compile.ops.kernel_policy import KernelPolicy
from ascend_compile.passes.pipeline import bucket_choices
from ascend_compile.passes.select_kernels import AttentionLayer
from ascend_compile.passes.workspaces import KernelSite, plan_workspaces
from ascend_compile.runtime.npu import NpuRuntime
from ascend_compile.targets import NpuTarget
from tests import fake_torch_npu

#: A Llama-3-8B layer: 32 query heads, 8 KV heads of 128, KV-cache blocks of 128 tokens.
SHAPE = tiling.AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, block_size=128)
PA_QUERY = "_npu_paged_attention_get_workspace"
FIA_QUERY = "_npu_fused_infer_attention_score_get_max_workspace"


@dataclasses.dataclass(frozen=True)
class ProbeCost:
    """Compile-time sizing of one model: graphs per kernel, queries per kernel, bytes at the peak."""

    pa_graphs: int
    fia_graphs: int
    pa_queries: int
    fia_queries: int
    peak_bytes: int
    total_bytes: int
    slot_bytes: int


def probe_cost(fake: fake_torch_npu.FakeNpu, max_model_len: int, layers: int = 2,
               shape: tiling.AttentionShape = SHAPE, dtype: torch.dtype = torch.bfloat16) -> ProbeCost:
    """Plan the workspaces of `layers` attention layers of `shape` for the default buckets and policy
    at `max_model_len` on the installed fake `fake`, counting what the sizing allocates and asks."""
    config = CompileConfig(max_model_len=max_model_len, runtime="npu")
    target = NpuTarget(NpuRuntime(torch.device("cpu")))
    need = target.workspace_need(config, dtype)
    choices = bucket_choices([AttentionLayer(shape, PLAIN)] * layers, config.capture_sizes, KernelPolicy())
    graphs = [(key, [KernelSite(f"attention_{i}", c.kernel, shape) for i, c in enumerate(chosen)])
              for key, chosen in choices.items()]
    before = {name: fake.count(name) for name in (PA_QUERY, FIA_QUERY)}
    with fake_torch_npu.AllocatedBytes() as memory:
        plan = plan_workspaces(graphs, max_model_len, None, True, need)
    kernels = [chosen[0].kernel for chosen in choices.values()]
    return ProbeCost(
        pa_graphs=kernels.count(tiling.PA), fia_graphs=kernels.count(tiling.FIA),
        pa_queries=fake.count(PA_QUERY) - before[PA_QUERY], fia_queries=fake.count(FIA_QUERY) - before[FIA_QUERY],
        peak_bytes=memory.peak, total_bytes=memory.total, slot_bytes=plan.slots["attn_workspace"].nbytes,
    )
