"""vLLM's own mixture-of-experts models (0.23.0) on the CPU, on vLLM's CPU MoE path, for `tests/test_vllm_moe.py`.

The model is vLLM's `Glm4MoeForCausalLM` (GLM-4.5's architecture: grouped top-k routing, sigmoid
scores with a correction bias, one shared expert), tiny, with random weights, built by
`tests/vllm_real.py`'s harness. Its experts are vLLM's `FusedMoE` layer on the path vLLM's own CPU
platform takes (`UnquantizedMoeBackend.CPU`): the routing traced into the graph
(`moe_runner._select_forward` calls `_moe_forward_shared` directly where `is_cpu()`, not the opaque
`vllm.moe_forward_shared` op), `cpu_fused_moe.grouped_topk` (`group_mask = zeros_like(group_scores);
group_mask.scatter_(1, group_idx, 1)`: an in-place op on a value the graph made), then
`CPUFusedMOE.forward_torch`'s custom op `vllm.cpu_fused_moe_torch`, which reads the per-expert token
counts on the host (`.cpu().numpy()`): the simulator refuses it inside a capture, so it runs between
pieces.

What stands in for vLLM's CPU platform is only its answer to `is_cpu()`, given to the modules that
ask it about MoE (the backend oracle, the MoE runner, the unquantized method): the harness's platform
stays CUDA-like for everything else (attention, collectives). vLLM's CUDA MoE path needs Triton
(`fused_experts`) and its CUDA `topk` kernels, neither of which runs on the CPU.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests import vllm_real as real

import vllm.model_executor.layers.fused_moe.oracle.unquantized as _oracle  # noqa: E402
import vllm.model_executor.layers.fused_moe.runner.moe_runner as _moe_runner  # noqa: E402
import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as _unquantized  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402


class CpuMoePlatform(real.CpuFlashAttnPlatform):
    """The harness's platform, saying `is_cpu()` (to the MoE modules only: vLLM's CPU MoE path)."""

    def is_cpu(self) -> bool:
        return True


_MOE_PLATFORM = CpuMoePlatform()
for _module in (_oracle, _moe_runner, _unquantized):
    _module.current_platform = _MOE_PLATFORM

#: A two-layer GLM-4.5 (`Glm4MoeForCausalLM`): 8 routed experts in 2 groups, the best group of each
#: token kept (`topk_group` 1), 2 experts a token, one shared expert, both layers MoE.
TINY_GLM4_MOE = {
    **real.TINY_LLAMA, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "moe_intermediate_size": 32,
    "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 0, "norm_topk_prob": True, "routed_scaling_factor": 1.5, "use_qk_norm": False,
    "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0, "attention_bias": False, "hidden_act": "silu",
}


def build(config: Any, seed: int = 0, num_blocks: int = 64) -> real.Model:
    """`vllm_real.build`'s model, then vLLM's profiling run on it (eagerly, before any compile): the MoE
    layers set their `moe_quant_config` at their first forward (`ensure_moe_quant_config_init`)."""
    model = real.build(config, seed, num_blocks)
    run_profile(model)
    return model


def run_profile(model: real.Model) -> None:
    with set_current_vllm_config(model.config):
        real.profile_run(model)


def compiled_and_eager(monkeypatch: Any, where: Path, options: dict | None = None, **config: Any) -> list[real.Model]:
    """The tiny GLM-4.5 built twice (seed 3): compiled through vLLM's mode-1 call, and eager."""
    return real.compiled_and_eager(monkeypatch, where, build, TINY_GLM4_MOE, options, **config)


def run(model: real.Model, step: real.Step) -> torch.Tensor:
    """`vllm_real.run` under the model's config: `vllm.cpu_fused_moe_torch` makes vLLM's `SiluAndMul`
    per call, which reads the current config (vLLM's worker has it set)."""
    with set_current_vllm_config(model.config):
        return real.run(model, step)
