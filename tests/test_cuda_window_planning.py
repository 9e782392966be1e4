"""CUDA-only planning (issue 46, area 7): on CUDA a bucket whose decode kernels are all FIA gets no mixed
graph (`CudaTarget.mixed_graph_kernels`: only PA is decode-only there), so its decode graph serves mixed
steps: a sliding-window layer's steps of 16 query tokens (speculative decoding's, a chunk of a prompt)
run on it. Its plan must be sized for those steps: the fixed-split workspace at the bucket's tokens, the
split count the graph's kernels are specialised with (`passes/device_lengths.py`), the capture's padding
packed as a mixed step's (`passes/padding.packed_capture`), and, with a length-dependent need, the
sites planned for up to the bucket's query tokens a sequence, whose window span is `window + 15` keys at
16 tokens, not the window (`passes/pipeline._sites_for`). On the CPU: CUDA's target over a runtime named
"cuda" running the device-length ops' reference kernels, which check their workspace at each call."""
from __future__ import annotations

import importlib

import torch

from ascend_compile.config import CompileConfig
from ascend_compile.ops import cuda, tiling
from ascend_compile.passes.pipeline import workspace_plan
from ascend_compile.passes.workspaces import GraphKey, kernel_sites, node_need
from ascend_compile.runtime.eager import EagerRuntime
from ascend_compile.targets import CudaTarget, Target
from examples.llama import LlamaConfig, PagedBatch, build

backend_mod = importlib.import_module("ascend_compile.backend")  # the module, not the function it exports

WINDOW = 10
#: Steps of 16 query tokens, each sequence's context past the window: one sequence of 16, two of 8, four
#: of 4, an uneven pair; and one of 16 beside one of 4 in the 32-token bucket (12 padded tokens packed).
SIXTEEN = [([300], [16]), ([100, 200], [8, 8]), ([60, 70, 80, 90], [4] * 4), ([500, 40], [9, 7]), ([300, 50], [16, 4])]


class CpuStandIn(EagerRuntime):
    """CUDA's runtime as the target sees it (its name, its SM count), running on the CPU."""

    name = "cuda"
    num_sms = 64


def _compile(cfg, config, target):
    """`cfg`'s model under `torch.compile` through the backend on `target(runtime)`; its artifacts."""
    artifacts = []

    def backend_fn(gm, example_inputs):
        artifacts.append(backend_mod.compile_graph(gm, example_inputs, config,
                                                   target=lambda device, c: target(CpuStandIn(device))))
        return artifacts[-1]

    torch._dynamo.reset()
    return torch.compile(build(cfg), backend=backend_fn), artifacts


def test_a_windowed_layers_16_token_steps_run_on_cudas_fia_decode_graphs_sized_for_them():
    """Sliding-window layers (window 10) on FIA in buckets 16 and 32 (`pa_max_batch=4`): no mixed graph
    is planned, the decode graphs serve the 16-token steps, each equal to eager (the reference kernels
    refuse a workspace short of `dev_workspace_nbytes(T, shape, S)`, so every call was sized); the slot
    is the largest of each bucket's fixed-split need at its own tokens and split count, the split count
    each graph's kernels were specialised with; each graph is captured with its padding packed."""
    cfg = LlamaConfig(num_layers=2, num_blocks=600, layer_types=("sliding", "sliding"), sliding_window=WINDOW)
    config = CompileConfig(max_model_len=1024, capture_sizes=(16, 32), pa_max_batch=4)
    fn, artifacts = _compile(cfg, config, CudaTarget)
    reference, batch = build(cfg), PagedBatch(cfg, seed=5)
    with torch.no_grad():
        # a decode step of 3, one of 20: the token count is traced dynamic (buckets 16 and 32)
        for lens, qlens in [([300] * 3, None), ([200] * 20, None), ([300] * 16, None)] + SIXTEEN:
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    dynamic = [a for a in artifacts if a.rewritten.buckets == (16, 32)]  # dynamo recompiles per batch layout
    art = dynamic[-1]
    assert all(set(a.rewritten.choices) == {GraphKey(16, True), GraphKey(32, True)} for a in dynamic)  # no mixed graph
    assert sum(a.served[("mixed", "full")] for a in dynamic) == len(SIXTEEN)
    assert sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
    entries = [e for a in dynamic for e in a.graphs.values()]
    assert entries and all(e.packed for e in entries)  # captured as the mixed steps they serve are padded
    shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    splits = cuda.gpu_splits(CpuStandIn.num_sms, config.max_model_len)
    specialised = {}  # each graph's kernels as specialised: (kernel, split count)
    for a in dynamic:
        for key, graph in a.describe()["graphs"].items():
            if key in {str(k) for k in a.specialized}:
                specialised.setdefault(key, set()).update((k["kernel"], k["num_splits"]) for k in graph["kernels"])
    assert specialised == {f"b{b}.decode": {(tiling.FIA, splits(tiling.FIA, shape, b))} for b in (16, 32)}
    expected = max(cuda.dev_workspace_nbytes(b, shape, splits(tiling.FIA, shape, b)) for b in (16, 32))
    assert art.rewritten.plan.slots["attn_workspace"].nbytes == expected
    # what a 16-token step's calls need, at the 16-token bucket's split count, fits
    assert expected >= cuda.dev_workspace_nbytes(16, shape, splits(tiling.FIA, shape, 16)) > 0


def test_a_decode_graph_serving_mixed_steps_is_planned_for_up_to_its_buckets_query_tokens_a_sequence():
    """The plan's sites (`pipeline.workspace_plan`) with the exact formula need (`workspaces.node_need`,
    the sizing of a length-dependent workspace), over the graph keys CUDA's target plans for a windowed
    FIA layer (window 1020: FIA splits every 1024 keys): the 16-token decode graph, with no mixed graph,
    serves steps of 16 query tokens in one sequence, whose span is 1035 keys (two splits), and is sized
    so; the simulator's decode graph of the same bucket, whose mixed steps have a graph of their own, is
    sized for one token a sequence (1020 keys, one split), its mixed graph for 16."""
    window, max_len = 1020, 2048
    cfg = LlamaConfig(num_layers=1, num_blocks=300, layer_types=("sliding",), sliding_window=window)
    config = CompileConfig(max_model_len=max_len, capture_sizes=(16,), pa_max_batch=4)
    shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    one_token, sixteen = (tiling.max_workspace(tiling.FIA, shape, 16, span).nbytes for span in (window, window + 15))
    assert one_token < sixteen  # the window's keys alone split once, those of 16 tokens twice
    planned = {}
    for name, target in (("cuda", CudaTarget), ("sim", Target)):
        fn, artifacts = _compile(cfg, config, target)
        with torch.no_grad():
            fn(**PagedBatch(cfg, seed=1).step([40] * 16))  # 16 tokens: a static graph of bucket 16
        rewritten = artifacts[-1].rewritten
        plan = workspace_plan(rewritten.choices, lambda key: kernel_sites(rewritten.variant_for(key).gm), config,
                              node_need)
        planned[name] = {key: needs[0].nbytes for key, needs in plan.needs.items()}
    assert planned["cuda"] == {"b16.decode": sixteen}
    assert planned["sim"] == {"b16.decode": one_token, "b16.mixed": sixteen}


def test_the_triton_fia_kernel_runs_a_windowed_16_token_step_in_the_decode_graphs_planned_workspace():
    """The CUDA kernel of the 16-token decode graph (Triton, interpreted on the CPU), given exactly the
    graph's planned workspace (`dev_workspace_nbytes(16, shape, S)`, S the plan's split count for the
    bucket) and a guard of garbage behind it, on each 16-token step shape of a windowed layer (window
    100: a span of 115 keys at 16 tokens, 8 or 9 key tiles of 16, more than the S splits sharing them):
    equal to the reference kernel and to dense attention over each token's own window; nothing written
    past the workspace (a split count above S would write other tokens' records)."""
    from tests.helpers import make_problem, triton_kernels
    from tests.test_triton_kernels import DEVICE, SPLITTY, assert_exact, run_triton

    kernels = triton_kernels("cuda_triton", DEVICE)
    window, guard = 100, 64
    for lens, qlens in [([300], [16]), ([100, 200], [8, 8]), ([60, 70, 80, 90], [4] * 4), ([500, 40], [9, 7])]:
        p = make_problem(lens, qlens, heads=8, kv_heads=2, dim=16, block_size=16, seed=len(lens))
        shape = tiling.AttentionShape.of(p.query, p.key_cache)
        splits = cuda.gpu_splits(CpuStandIn.num_sms, 1024)(tiling.FIA, shape, 16)
        assert splits > 1 and p.query.shape[0] == 16
        out, ws = run_triton(kernels, p, splits, decode=False, guard=guard, workspace=True, window=window, **SPLITTY)
        assert ws.numel() - guard == cuda.dev_workspace_nbytes(16, shape, splits)
        assert_exact(out, p, splits, False, window=window)
        assert torch.equal(ws[-guard:], torch.full((guard,), 0xFF, dtype=torch.uint8)), lens
