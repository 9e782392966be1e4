"""vLLM's own model tensor-parallel over CPU ranks (gloo), compiled by our backend through vLLM's
mode-1 call on every rank, each step compared with the same rank's eager copy of the model.

vLLM's collectives go through its custom ops (`torch.ops.vllm.all_reduce`: `CpuFlashAttnPlatform`
opts in, as CUDA does), whose body is `dist.all_reduce` in place: the shape the simulator once ran at
capture only, returning each rank's partial sums at replay. Each rank is a spawned interpreter
(vLLM's process groups are global state); `spawn_ranks` returns every rank's results.
"""
from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.multiprocessing as mp

from examples.tensor_parallel import join_ranks


def _rank(rank: int, world: int, store: str, out_dir: str, hf_config: dict | None, steps: Sequence, options: dict
          ) -> None:
    """One rank: vLLM's groups of `world` ranks, the model built twice (compiled, eager), every step run on both."""
    torch.set_num_threads(1)
    os.environ["ASCEND_COMPILE_OPTIONS"] = json.dumps(options)
    from tests import vllm_real as real
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    result: dict[str, Any] = {"errors": [], "outputs": []}
    try:
        work = Path(out_dir) / f"rank{rank}"
        configs = []
        for mode in (1, 0):
            (work / f"mode{mode}").mkdir(parents=True)
            configs.append(real.vllm_config(work / f"mode{mode}", compile_mode=mode, hf_config=hf_config))
        with set_current_vllm_config(configs[0]):
            parallel_state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                                        distributed_init_method=f"file://{store}", backend="gloo")
            parallel_state.ensure_model_parallel_initialized(world, 1)
        result["custom_op_collectives"] = parallel_state.get_tp_group().use_custom_op_call
        models = [real.build(config, seed=3) for config in configs]
        artifacts: list[Any] = []
        from ascend_compile.integrations import vllm as integration
        original = integration.backend
        integration.dynamo_backend.backend = lambda *a, **k: original(*a, on_compiled=artifacts.append, **k)
        real.compile_as_vllm(models[0])
        for seq_lens, query_lens in steps:
            step = real.Step(list(seq_lens), list(query_lens))
            got, expected = real.run(models[0], step), real.run(models[1], step)
            result["errors"].append((got - expected).abs().max().item())
            result["outputs"].append(got.clone())
        result["cache_errors"] = [(a - b).abs().max().item() for a, b in zip(models[0].caches(), models[1].caches())]
        stats: dict[str, int] = {}
        for artifact in artifacts:
            for key, value in artifact.stats.items():
                stats[key] = stats.get(key, 0) + value
        result["stats"] = stats
    except Exception:
        result["failure"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def spawn_ranks(steps: Sequence, world: int = 2, hf_config: dict | None = None, options: dict | None = None,
                timeout: float = 600.0, workdir: str | None = None) -> list[dict]:
    """Every rank's results (`errors`, `outputs`, `cache_errors`, `stats`, or `failure`: a traceback).
    Raises TimeoutError (after killing the ranks) past `timeout` seconds."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        args = (world, os.path.join(tmp, "store"), tmp, hf_config, tuple(steps), options or {})
        ctx = mp.start_processes(_rank, args=args, nprocs=world, join=False, start_method="spawn")
        return join_ranks(ctx, world, tmp, timeout)
