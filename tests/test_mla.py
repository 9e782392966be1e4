"""Multi-head latent attention (`ops/mla.py`): the kernel against the dense oracle (the latent
decompressed into per-head K/V), the cache write, the real and exactly planned workspace, the
DeepSeek-style example compiled and replayed across buckets, and the refusals where MLA is not served
(npugraph_ex; runtime "npu" serves it: `tests/test_mla_npu.py`; its CUDA path: tests/test_triton_mla.py
and tests/test_mla_cuda.py)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from ascend_compile.errors import WorkspaceTooSmall
from ascend_compile.ops import reference, tiling
from ascend_compile.passes.workspaces import KernelSite, node_need
from examples.deepseek import DeepSeekConfig, build
from examples.llama import PagedBatch
from tests.mla_helpers import make_mla_problem
from tests.test_backend import compiled_model

TOL = dict(atol=2e-5, rtol=1e-4)
#: Lengths around block boundaries (block_size 16), past one split (128) and past the long-chunk switch (1024).
LENGTHS = [15, 16, 17, 33, 1, 129, 300, 1030]


@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("query_lens", [None, [1, 4, 2, 16, 1, 3, 7, 2]], ids=["decode", "mixed"])
def test_mla_equals_the_dense_oracle(heads, query_lens):
    problem = make_mla_problem(LENGTHS, query_lens, heads=heads, seed=heads)
    torch.testing.assert_close(problem.attend(), problem.dense(), **TOL)


@pytest.mark.parametrize("kv_lora_rank, rope_dim", [(64, 16), (8, 2)])
def test_mla_equals_the_dense_oracle_at_other_ranks(kv_lora_rank, rope_dim):
    problem = make_mla_problem([40, 257, 5], [2, 1, 5], heads=2, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                               block_size=32)
    torch.testing.assert_close(problem.attend(), problem.dense(), **TOL)


def test_padding_rows_are_zeros():
    """Sequences of length 0 (the runner's padding) give zeros, whatever their query rows hold."""
    problem = make_mla_problem([40, 0, 200, 0], [2, 1, 1, 1])
    out = problem.attend()
    assert out[2].abs().sum() == 0 and out[4].abs().sum() == 0
    torch.testing.assert_close(out, problem.dense(), **TOL)


def test_the_rope_part_is_in_the_score():
    problem = make_mla_problem([50, 70], [1, 3])
    expected = problem.dense()
    problem.q_pe = torch.zeros_like(problem.q_pe)
    assert (problem.attend() - expected).abs().max() > 1e-3


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_the_cache_write_skips_slot_minus_one(slot_dtype):
    kv_c_cache, k_pe_cache = torch.zeros(4, 16, 8), torch.zeros(4, 16, 2)
    kv_c, k_pe = torch.randn(3, 8), torch.randn(3, 2)
    slots = torch.tensor([17, -1, 40], dtype=slot_dtype)
    torch.ops.ascend.mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slots)
    torch.testing.assert_close(kv_c_cache[1, 1], kv_c[0])
    torch.testing.assert_close(k_pe_cache[2, 8], k_pe[2])
    assert int((kv_c_cache.abs().sum(-1) > 0).sum()) == 2 and int((k_pe_cache.abs().sum(-1) > 0).sum()) == 2
    with pytest.raises(ValueError, match="slot_mapping: expected slots below 64"):
        torch.ops.ascend.mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, torch.tensor([64, 0, 1]))
    with pytest.raises(ValueError, match="slot_mapping: expected a \\[3\\] torch.int32 or torch.int64 tensor"):
        torch.ops.ascend.mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, torch.tensor([0.0, 1.0, 2.0]))


@pytest.mark.parametrize("bad, message", [
    ("q_pe", r"q_pe: expected a \[2, 4, rope_dim\] tensor"),
    ("k_pe_cache", r"k_pe_cache: expected a \[\d+, 16, 8\] tensor"),
    ("kv_c_cache", r"kv_c_cache: expected a \[num_blocks, block_size, 32\] tensor"),
])
def test_bad_shapes_are_refused_naming_the_argument(bad, message):
    problem = make_mla_problem([5, 9])
    tensor = getattr(problem, bad)
    setattr(problem, bad, tensor[..., :-1] if bad != "q_pe" else tensor[:1])
    with pytest.raises(ValueError, match=message):
        problem.attend()


def _kernel_call(problem, workspace):
    out = torch.empty(problem.q_full.shape[0], problem.q_full.shape[1], problem.kv_c_cache.shape[2])
    torch.ops.ascend.mla_fused_infer_attention(problem.q_nope, problem.q_pe, problem.kv_c_cache, problem.k_pe_cache,
                                               problem.block_table, problem.query_start_loc[1:], problem.seq_lens,
                                               problem.scale, workspace, out)
    return out


def test_the_workspace_is_really_used(monkeypatch):
    """Split partials go through the workspace: a short one is refused, a corrupted one changes the result."""
    problem = make_mla_problem([300, 900], [1, 2])
    shape = tiling.AttentionShape(4, 1, 32, 16, rope_dim=8)
    need = tiling.workspace_nbytes(tiling.MLA, shape, problem.seq_lens, problem.query_lens)
    assert need == (1 * 3 + 2 * 8) * shape.num_heads * (32 + 1) * 4  # 300 keys: 3 chunks of 128; 900: 8
    with pytest.raises(WorkspaceTooSmall):
        _kernel_call(problem, torch.zeros(need - 1, dtype=torch.uint8))
    clean = _latent(problem)
    torch.testing.assert_close(_kernel_call(problem, torch.zeros(need, dtype=torch.uint8)), clean)
    monkeypatch.setattr(reference, "between_split_and_reduce", lambda ws: ws.mul_(0.5))
    assert (_kernel_call(problem, torch.zeros(need, dtype=torch.uint8)) - clean).abs().max() > 1e-3


def _latent(problem):
    seq_lens, query_start_loc = problem.tensors()
    return torch.ops.ascend.mla_attention(problem.q_nope, problem.q_pe, problem.kv_c_cache, problem.k_pe_cache,
                                          problem.block_table, seq_lens, query_start_loc, problem.scale)


@pytest.mark.parametrize("max_query, tokens, max_len", [(1, 8, 3000), (4, 8, 3000), (1, 4, 600)])
def test_the_mla_workspace_plan_is_the_brute_force_maximum(max_query, tokens, max_len):
    """Over every step of `tokens` query tokens in sequences of at most `max_query` tokens, of every
    KV length up to max_model_len; MLA's need peaks at an interior length (897), not at the longest."""
    shape = tiling.AttentionShape(16, 1, 512, 16, rope_dim=64)
    need = node_need(KernelSite("mla", tiling.MLA, shape, max_query_len=max_query), tokens, max_len, None)
    by_len = {}
    for q in range(1, max_query + 1):
        for kv in range(q, max_len + 1):
            nbytes = tiling.workspace_nbytes(tiling.MLA, shape, [kv] * (tokens // q), [q] * (tokens // q))
            by_len[kv] = max(by_len.get(kv, 0), nbytes)
    brute = max(by_len.values())
    assert (need.exact_nbytes, need.exact_argmax_len) == (brute, min(kv for kv, n in by_len.items() if n == brute))
    assert need.exact_argmax_len == (897 if max_len >= 897 else 513)
    if max_len > tiling.MLA_LONG_SEQ:  # sizing at max_model_len would leave the interior peak short
        assert need.exact_nbytes > tiling.workspace_nbytes(tiling.MLA, shape, [max_len] * tokens)


# ----------------------------------------------------------------------------- the example model, compiled

CFG = DeepSeekConfig(num_layers=3, num_blocks=600)
MAX_LEN = 1200
BUCKETS = (2, 4, 8)


def _steps():
    rng = random.Random(26)
    steps = [[rng.randint(1, MAX_LEN) for _ in range(n)] for n in (3, 2, 7, 4, 8, 1, 5)]
    steps += [([30, 900, 97], [3, 1, 2]), ([60, 1], [5, 1]), ([120, 16, 17, 1100], [1, 2, 1, 4])]
    return steps


def test_the_deepseek_example_is_replayed_from_captured_graphs_and_equals_eager(tmp_path):
    """Decode and mixed steps across buckets, each one a replay; one MLA kernel per layer in every
    bucket; the update table refreshes FIA v2's lengths; the slot is the exact maximum."""
    model, reference_model = build(CFG), build(CFG)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=BUCKETS, sim_overflow="raise",
                                   dump_dir=str(tmp_path), piecewise_sizes=[])  # the bucket graphs' exact slot
    batch = PagedBatch(CFG, seed=26)
    steps = _steps()
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference_model(**inputs), **TOL)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    assert sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
    art = max(artifacts, key=lambda a: len(a.graphs))
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    # MLA's decode and mixed calls take two branches of FIA v2 (`Target.mixed_graph_kernels`): two graphs a bucket
    assert set(plan["graphs"]) == {f"b{b}.{kind}" for b in BUCKETS for kind in ("decode", "mixed")}
    for graph in plan["graphs"].values():
        assert [k["kernel"] for k in graph["kernels"]] == [tiling.MLA] * CFG.num_layers
    table = art.describe()["graphs"]["b8.decode"]["update_table"]
    assert [e["node"] for e in table] == ["mla_fused_infer_attention_default", "mla_fused_infer_attention_default_1",
                                          "mla_fused_infer_attention_default_2"]
    assert table[0]["refresh"] == {"actual_seq_qlen": {"input": "l_query_start_loc_", "conversion": "ends"},
                                   "actual_seq_kvlen": {"input": "l_seq_lens_", "conversion": "list"}}
    shape = tiling.AttentionShape(CFG.num_heads, 1, CFG.kv_lora_rank, CFG.block_size, CFG.qk_rope_head_dim)
    brute = max(tiling.workspace_nbytes(tiling.MLA, shape, [kv] * (max(BUCKETS) // q), [q] * (max(BUCKETS) // q))
                for q in (1, 2, 4, 8) for kv in range(q, MAX_LEN + 1))
    (slot,) = plan["workspace"]["slots"].values()
    assert (slot["nbytes"], slot["argmax_len"]) == (brute, 897)


def test_a_model_mixing_latent_and_plain_attention_takes_the_kernel_per_layer():
    """PA/FIA by the bucket's policy for plain layers, MLA for latent ones, in one graph."""
    from examples.llama import LlamaConfig
    from examples.llama import build as build_llama

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = build_llama(LlamaConfig(num_layers=1, num_blocks=600))
            self.deepseek = build(DeepSeekConfig(num_layers=1, num_blocks=600))

        def forward(self, **inputs):
            return self.llama(**inputs) + self.deepseek(**inputs)

    fn, artifacts = compiled_model(Mixed(), max_model_len=512, capture_sizes=(4, 8), pa_max_batch=4,
                                   sim_overflow="raise")
    reference_model = Mixed()
    batch = PagedBatch(CFG, seed=3)
    with torch.no_grad():
        for lens, qlens in (([100, 7, 300], None), ([50, 60, 70, 80, 90, 1], None), ([40, 9], [3, 2])):
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference_model(**inputs), **TOL)
    assert sum(a.stats["replays"] for a in artifacts) == 3
    graphs = artifacts[-1].describe()["graphs"]
    assert [k["kernel"] for k in graphs["b4.decode"]["kernels"]] == [tiling.PA, tiling.MLA]
    assert [k["kernel"] for k in graphs["b4.mixed"]["kernels"]] == [tiling.FIA, tiling.MLA]
    assert [k["kernel"] for k in graphs["b8.decode"]["kernels"]] == [tiling.FIA, tiling.MLA]


# ----------------------------------------------------------------------------- where MLA is not served


def test_mla_layers_of_dims_the_triton_tiles_were_not_checked_for_are_refused_on_cuda():
    from ascend_compile.runtime.eager import EagerRuntime
    from ascend_compile.targets import CudaTarget

    cfg = DeepSeekConfig(num_layers=1, kv_lora_rank=1024, num_blocks=64)
    fn, _ = compiled_model(build(cfg), target=lambda d, c: CudaTarget(EagerRuntime(d)), max_model_len=256,
                           capture_sizes=(4,))
    with pytest.raises(Exception, match=r"layer L\['self'\].layers.0.attn \(node \w+\): runtime 'cuda' serves "
                                        r"latent attention of kv_lora_rank <= 512 and rope_dim <= 64 .* got "
                                        r"kv_lora_rank 1024"):
        with torch.no_grad():
            fn(**PagedBatch(cfg).step([5, 6]))


def test_mla_is_refused_by_the_npugraph_ex_pass_naming_the_layer():
    from ascend_compile.config import CompileConfig
    from ascend_compile.passes.torchair import rewrite_for_npugraph_ex

    graphs = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build(CFG), backend=lambda gm, _: graphs.append(gm) or gm.forward)(**PagedBatch(CFG).step([5, 6]))
    with pytest.raises(ValueError, match=r"layer L\['self'\].layers.0.attn \(node \w+\): npugraph_ex does not serve "
                                         r"latent attention .* host lists, which npugraph_ex refreshes only from SymInt"):
        rewrite_for_npugraph_ex(graphs[0], CompileConfig(max_model_len=256))
