"""vLLM's own mixture-of-experts model (0.23.0 or 0.33.0) on the CPU, on vLLM's CPU MoE path, for
`tests/test_vllm_moe.py`.

The model is vLLM's `Glm4MoeForCausalLM` (GLM-4.5's architecture: grouped top-k routing, sigmoid
scores with a correction bias, one shared expert), tiny, with random weights, built by
`tests/vllm_real.py`'s harness. Its experts are vLLM's `FusedMoE` layer on the path vLLM's own CPU
platform takes (`UnquantizedMoeBackend.CPU`): the routing traced into the graph
(`moe_runner._select_forward` calls `_moe_forward_shared` directly where `is_cpu()`, not the opaque
`vllm.moe_forward_shared` op), grouped top-k in Python (0.23: `cpu_fused_moe.grouped_topk`; 0.33:
`router/cpu_router.py`'s `_grouped_topk`), whose `group_mask = zeros_like(group_scores);
group_mask.scatter_(1, group_idx, 1)` is an in-place op on a value the graph made, then the experts:
- 0.23: `CPUFusedMOE.forward_torch`'s custom op `vllm.cpu_fused_moe_torch` (vLLM's pure-torch path, taken
  where `torch.ops._C.prepack_moe_weight` is missing), which reads the per-expert token counts on the
  host (`.cpu().numpy()`): the simulator refuses it inside a capture, so it runs between pieces;
- 0.33: the modular kernel's `CPUUnquantizedExperts`, whose two calls into vLLM's CPU build
  (`cpu_prepack_moe_weight`, `cpu_fused_moe`: `torch.ops._C`, absent from the CUDA wheel) are stood in
  for here in pure torch, reading nothing on the host, as the kernel.

What stands in for vLLM's CPU platform is only its kind (`PlatformEnum.CPU`), given to the modules
that ask it about MoE: the harness's platform stays CUDA-like for everything else (attention,
collectives). vLLM's CUDA MoE path needs Triton (`fused_experts`) and its CUDA top-k kernels.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from tests import vllm_real as real

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.platforms.interface import PlatformEnum  # noqa: E402


class CpuMoePlatform(real.CpuFlashAttnPlatform):
    """The harness's platform as vLLM's CPU platform's kind (`PlatformEnum.CPU`: `is_cpu()`, not
    out of tree), given to the MoE modules only: vLLM's CPU MoE path."""

    _enum = PlatformEnum.CPU


_MOE_PLATFORM = CpuMoePlatform()
#: The modules asking `is_cpu()` about MoE: 0.23's three; 0.33's router factory, modular kernel and CPU
#: experts too (its CPU path is a modular kernel: `CPURouter`, `CPUUnquantizedExperts`).
_ASKING = ["oracle.unquantized", "runner.moe_runner", "unquantized_fused_moe_method", "router.router_factory",
           "modular_kernel", "experts.cpu_moe"]
for _name in _ASKING:
    try:
        _module = importlib.import_module(f"vllm.model_executor.layers.fused_moe.{_name}")
    except ModuleNotFoundError:  # not in this release
        continue
    _module.current_platform = _MOE_PLATFORM


#: Whether vLLM's CPU experts read the expert counts on the host: 0.23's `vllm.cpu_fused_moe_torch` (no
#: `torch.ops._C.prepack_moe_weight` here), not 0.33's modular kernel (its CPU kernel's stand-in below).
HOST_READ_EXPERTS = importlib.util.find_spec("vllm.model_executor.layers.fused_moe.cpu_fused_moe") is not None


@torch.library.custom_op("vllm_moe_cpu::cpu_fused_moe", mutates_args=("out",))
def cpu_fused_moe(out: torch.Tensor, input: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act: str, isa: str, skip_weighted: bool = False) -> None:
    """vLLM 0.33's `_custom_ops.cpu_fused_moe` (`torch.ops._C.cpu_fused_moe`, vLLM's CPU build only) in
    pure torch, over the unpacked weights (`cpu_prepack_moe_weight` below keeps them as they are):
    each token's `topk` experts, `w2 @ silu(gate) * up` of `w13 @ x` (gate: the first half), weighted by
    its routing weights unless `skip_weighted`. Every expert over every token, masked: no host read,
    as the kernel's (a device graph holds it)."""
    assert act == "silu" and w13_bias is None and w2_bias is None, (act, w13_bias, w2_bias)
    x = input.float()
    gate_up = torch.einsum("th,eih->tei", x, w13.float())
    gate, up = gate_up.chunk(2, dim=-1)
    experts = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(gate) * up, w2.float())
    onehot = (topk_ids.long().unsqueeze(-1) == torch.arange(w13.shape[0])).float()  # [t, k, e]
    weights = torch.ones_like(topk_weights, dtype=torch.float) if skip_weighted else topk_weights.float()
    out.copy_(torch.einsum("tke,tk,teh->th", onehot, weights, experts).to(out.dtype))


@cpu_fused_moe.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_kernels() -> None:
    """0.33's CPU experts on the stand-in: `cpu_fused_moe` above, prepacking that keeps the layout."""
    if HOST_READ_EXPERTS:  # 0.23: its CPU experts are `cpu_fused_moe.CPUFusedMOE`, in pure torch
        return
    cpu_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    cpu_moe.cpu_fused_moe = torch.ops.vllm_moe_cpu.cpu_fused_moe
    cpu_moe.cpu_prepack_moe_weight = lambda weight, isa: weight.clone()


_cpu_kernels()

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
    layers set their `moe_quant_config` at their first forward (`ensure_moe_quant_config_init`). Where an
    earlier model of the process (a dense one, `vllm_real`'s) made the model-parallel groups, vLLM left
    out the expert-parallel group it makes only for MoE models: the groups are made again under `config`."""
    if parallel_state._WORLD is not None and parallel_state._EP is None:
        parallel_state.destroy_model_parallel()
        with set_current_vllm_config(config):
            parallel_state.ensure_model_parallel_initialized(1, 1)
    model = real.build(config, seed, num_blocks)
    run_profile(model)
    return model


def run_profile(model: real.Model) -> None:
    with set_current_vllm_config(model.config):
        real.profile_run(model)


def compiled_and_eager(monkeypatch: Any, where: Path, options: dict | None = None, **config: Any) -> list[real.Model]:
    """The tiny GLM-4.5 built twice (seed 3): compiled through vLLM's mode-1 call, and eager."""
    return real.compiled_and_eager(monkeypatch, where, build, TINY_GLM4_MOE, options, **config)


def reload_weights(model: real.Model, seed: int) -> None:
    """A weight reload as vLLM's `reload_weights` makes it after a sleep (level 2) and wake: new values
    (seeded) written into the same parameters, then vLLM's `process_weights_after_loading` again (the
    MoE method's CPU set-up included)."""
    generator = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(model.config), torch.no_grad():
        for param in model.model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        process_weights_after_loading(model.model, model.config.model_config, torch.device("cpu"))


def run(model: real.Model, step: real.Step) -> torch.Tensor:
    """`vllm_real.run` under the model's config: `vllm.cpu_fused_moe_torch` makes vLLM's `SiluAndMul`
    per call, which reads the current config (vLLM's worker has it set)."""
    with set_current_vllm_config(model.config):
        return real.run(model, step)
