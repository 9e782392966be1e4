"""vLLM's own multi-LoRA serving (0.23.0 or 0.33.0) on the tiny Llama of `tests/vllm_real.py`, on the CPU.

What vLLM's `GPUModelRunner` does with `--enable-lora`, by vLLM's own code: a `LoRAConfig` in the
`VllmConfig`; `load_model` wraps the loaded model with vLLM's LoRA layers
(`LoRAModelRunnerMixin.load_lora_model` -> `vllm.lora.model_manager.create_lora_manager`) before it
compiles it; adapters are added and activated into the layers' stacked weights
(`LoRAModelManager.add_adapter` / `activate_adapter`: `lora_a_stacked` `[max_loras, 1, rank, in]`,
`lora_b_stacked` `[max_loras, 1, out, rank]`); before each step `set_active_loras` gives the
per-token and per-request adapter mapping (`LoRAMapping(..., is_prefill=True)`,
`set_adapter_mapping`, which fills the punica wrapper's metadata in place). The adapters' weights
are seeded random (`create_dummy_lora`, then filled), the same in the compiled and the eager copy.

The punica wrapper is vLLM's CUDA one, `PunicaWrapperGPU`, the one made for compiled graphs (its
`LoRAKernelMeta`: per-token slot ids sliced by the activations' rows, `meta_args(x.size(0))`, and
the no-LoRA flag as a CPU tensor, all read inside opaque ops). What stands in for the GPU is only
its two Triton kernel calls, `lora_shrink` and `lora_expand`: custom ops here with pure-torch bodies
doing what the kernels do for the step's tokens (each token's rows through its adapter slot's
weights; tokens of no adapter, and every token under the no-LoRA flag, left alone), without a host
read; the platform names that wrapper while the manager is made
(`CpuFlashAttnPlatform.get_punica_wrapper` names vLLM's pure-torch `PunicaWrapperCPU`, the
stand-ins' reference in eager), and reports no pinned memory (pinning needs a CUDA driver).
`PunicaWrapperCPU` does not compile: vLLM's runner sets `is_prefill=True`, whose SGMV ops size a
tensor by data (`torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)`,
`vllm/lora/ops/torch_ops/lora_ops.py:19`; dynamo: "Could not guard on data-dependent expression
Eq(u0, 1)" at line 38), and its BGMV path slices by `indices_len`, Python ints of module state that
dynamo specializes (a recompile per token count); vLLM's own CPU platform turns compilation off with
LoRA (`vllm/platforms/cpu.py:206`). vLLM's profile run maps every token slot before any step
(`build`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from tests import vllm_real as real

from vllm.config import LoRAConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.lora.layers import LoRAMapping  # noqa: E402


def _import_model_manager() -> Any:
    """`vllm.lora.model_manager`. In 0.23 it imports `vllm.multimodal.encoder_budget` (for multimodal
    models only), whose chain (`vllm.v1.request` -> `vllm.v1.structured_output.request`) runs the
    `vllm.v1.structured_output` package's `__init__`, which imports the guidance and xgrammar backends
    (`llguidance`, `xgrammar`: not installed in `.venv-vllm`). Where that fails, the package's `__init__`
    is skipped for this import only (its submodules are vLLM's own files), then forgotten again."""
    try:
        return importlib.import_module("vllm.lora.model_manager")
    except ModuleNotFoundError as exc:
        if exc.name not in ("llguidance", "xgrammar"):
            raise
    import vllm.v1

    name = "vllm.v1.structured_output"
    package = types.ModuleType(name)
    package.__path__ = [str(Path(vllm.v1.__file__).parent / "structured_output")]
    sys.modules[name] = package
    try:
        return importlib.import_module("vllm.lora.model_manager")
    finally:
        if sys.modules.get(name) is package:
            del sys.modules[name]


_model_manager = _import_model_manager()
LoRAModelManager, create_lora_manager = _model_manager.LoRAModelManager, _model_manager.create_lora_manager


def _unpinned() -> None:
    """No pinned host memory (pinning needs a CUDA driver): the platform says so (0.23's LoRA weights
    ask `is_pin_memory_available()` at each allocation); `PIN_MEMORY`, read once at import, is set false
    in `vllm.utils.torch_utils` and where vLLM's LoRA modules imported it (0.33); 0.23's
    `async_tensor_h2d`, whose `pin_memory` default was bound at import, is called with False where the
    punica wrapper's `convert_mapping` calls it."""
    from vllm.lora.punica_wrapper import utils as punica_utils
    from vllm.utils import torch_utils

    real.CpuFlashAttnPlatform.is_pin_memory_available = classmethod(lambda cls: False)
    for name in ("vllm.utils.torch_utils", "vllm.lora.lora_weights", "vllm.lora.lora_model", "vllm.lora.model_manager"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "PIN_MEMORY"):
            module.PIN_MEMORY = False
    if "pin_memory" in inspect.signature(torch_utils.async_tensor_h2d).parameters:
        punica_utils.async_tensor_h2d = functools.partial(torch_utils.async_tensor_h2d, pin_memory=False)


_unpinned()


# ---------------------------------------------------------------- the two Triton kernel calls


def _adapter_rows(token_lora_mapping: torch.Tensor, no_lora_flag_cpu: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's slot, clamped to a valid one; which rows have an adapter), on the device: the kernels'
    walk over `LoRAKernelMeta` (slot -1, no adapter, skipped; nothing at all under the no-LoRA flag,
    which `prepare_tensors` sets without refreshing the mapping) as tensor ops, so that a graph capture
    holds them (no host read)."""
    slots = token_lora_mapping.long()
    return slots.clamp(min=0), (slots >= 0) & ~no_lora_flag_cpu.to(slots.device)


def _stacked(weight: torch.Tensor) -> torch.Tensor:
    """A stacked weight `[slots, 1, n, k]` (or `[slots, n, k]`) as `[slots, n, k]`, as the kernels read it."""
    return weight.squeeze(1) if weight.dim() == 4 else weight


@torch.library.custom_op("vllm_lora_cpu::lora_shrink", mutates_args=("output_tensor",))
def lora_shrink(inputs: torch.Tensor, lora_a_weights: list[torch.Tensor], output_tensor: torch.Tensor,
                token_lora_mapping: torch.Tensor, token_indices_sorted_by_lora_ids: torch.Tensor,
                num_tokens_per_lora: torch.Tensor, lora_token_start_loc: torch.Tensor, lora_ids: torch.Tensor,
                no_lora_flag_cpu: torch.Tensor, num_active_loras: torch.Tensor, scaling: float) -> None:
    """`vllm.lora.ops.triton_ops.lora_shrink`: `output[s, t] = scaling * inputs[t] @ A_s[slot(t)]^T` for
    the rows of an adapter, 0 for the others."""
    slots, used = _adapter_rows(token_lora_mapping, no_lora_flag_cpu)
    for s, weight in enumerate(lora_a_weights):
        value = torch.einsum("tk,tnk->tn", inputs.float(), _stacked(weight)[slots].float()) * scaling
        output_tensor[s] = torch.where(used.unsqueeze(-1), value, 0).to(output_tensor.dtype)


@lora_shrink.register_fake
def _(*args: Any) -> None:
    return None


@torch.library.custom_op("vllm_lora_cpu::lora_expand", mutates_args=("output_tensor",))
def lora_expand(inputs: torch.Tensor, lora_b_weights: list[torch.Tensor], output_tensor: torch.Tensor,
                token_lora_mapping: torch.Tensor, token_indices_sorted_by_lora_ids: torch.Tensor,
                num_tokens_per_lora: torch.Tensor, lora_token_start_loc: torch.Tensor, lora_ids: torch.Tensor,
                no_lora_flag_cpu: torch.Tensor, num_active_loras: torch.Tensor, offset_start: int = 0,
                add_inputs: bool = False) -> None:
    """`vllm.lora.ops.triton_ops.lora_expand`: slice s of `output[t]` (its columns from `offset_start`,
    the slices' widths in turn) gets `inputs[s, t] @ B_s[slot(t)]^T`, added where `add_inputs`, for the
    rows of an adapter; the others are left alone."""
    slots, used = _adapter_rows(token_lora_mapping, no_lora_flag_cpu)
    offset = offset_start
    for s, weight in enumerate(lora_b_weights):
        b = _stacked(weight)
        columns = slice(offset, offset + b.shape[-2])
        region = output_tensor[:, columns]
        value = torch.einsum("tk,tnk->tn", inputs[s].float(), b[slots].float()).to(output_tensor.dtype)
        output_tensor[:, columns] = torch.where(used.unsqueeze(-1), region + value if add_inputs else value, region)
        offset += b.shape[-2]


@lora_expand.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


#: vLLM's CUDA punica wrapper, named by the platform while the LoRA manager is made; its pure-torch one
#: (eager only: the stand-in kernels' reference).
PUNICA_GPU = "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"
PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


def _gpu_punica_wrapper() -> None:
    """`punica_gpu` as vLLM has it with Triton: vLLM's own `LoRAKernelMeta` (pure torch; the module
    imports it only `if HAS_TRITON`, false without a GPU) and the stand-in kernels above."""
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    from vllm.lora.punica_wrapper import punica_gpu

    punica_gpu.LoRAKernelMeta = LoRAKernelMeta
    punica_gpu.lora_shrink = torch.ops.vllm_lora_cpu.lora_shrink
    punica_gpu.lora_expand = torch.ops.vllm_lora_cpu.lora_expand


_gpu_punica_wrapper()


@contextlib.contextmanager
def _platform_punica(qualname: str) -> Iterator[None]:
    """The platform's `get_punica_wrapper` naming `qualname` (vLLM's manager asks it once, when made)."""
    platform = real.CpuFlashAttnPlatform
    saved = platform.__dict__.get("get_punica_wrapper")
    platform.get_punica_wrapper = classmethod(lambda cls: qualname)
    try:
        yield
    finally:
        if saved is None:
            del platform.get_punica_wrapper
        else:
            platform.get_punica_wrapper = saved

#: The adapters every model gets: vLLM's LoRA ids (0 is "no adapter").
ADAPTERS = (1, 2)
RANK = 8


def vllm_config(model_dir: Path, compile_mode: int = 0, max_loras: int = len(ADAPTERS), max_lora_rank: int = RANK,
                **config: Any) -> VllmConfig:
    """`vllm_real.vllm_config`'s config with a `LoRAConfig` (the same fields in 0.23 and 0.33:
    `max_loras`, `max_lora_rank`, `lora_dtype`), as `--enable-lora --max-loras 2` gives it."""
    return real.vllm_config(model_dir, compile_mode, lora_config=LoRAConfig(max_loras=max_loras,
                                                                           max_lora_rank=max_lora_rank), **config)


@dataclasses.dataclass
class LoraModel(real.Model):
    """`vllm_real.Model` wrapped by vLLM's LoRA manager, its adapters active."""

    manager: LoRAModelManager | None = None

    def set_mapping(self, step: "LoraStep") -> None:
        """`set_active_loras` for one step: each token's and each request's adapter id."""
        self.manager.set_adapter_mapping(step.mapping())


def adapter_weights(manager: LoRAModelManager, lora_id: int, embedding_modules: dict[str, str]) -> Any:
    """vLLM's zero adapter for every LoRA module (`create_dummy_lora`), filled with seeded random
    weights (the seed is the adapter's id: the same adapter in every model built)."""
    adapter = manager.create_dummy_lora(lora_id, RANK, embedding_modules)
    generator = torch.Generator().manual_seed(1000 + lora_id)
    for name in sorted(adapter.loras):
        lora = adapter.loras[name]
        for part in ("lora_a", "lora_b"):
            tensors = getattr(lora, part)
            for tensor in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
                if tensor is not None:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return adapter


def build(config: VllmConfig, seed: int = 0, num_blocks: int = 64, punica: str = PUNICA_GPU) -> LoraModel:
    """`vllm_real.build`'s model wrapped by vLLM's LoRA manager (as `load_model` does before it compiles),
    its punica wrapper `punica`, with the adapters `ADAPTERS` added and activated."""
    base = real.build(config, seed, num_blocks)
    scheduler = config.scheduler_config
    with set_current_vllm_config(config), _platform_punica(punica):
        manager = create_lora_manager(base.model, max_num_seqs=scheduler.max_num_seqs,
                                      max_num_batched_tokens=scheduler.max_num_batched_tokens,
                                      vocab_size=config.model_config.get_vocab_size(),
                                      lora_config=config.lora_config, vllm_config=config, device=torch.device("cpu"))
        for lora_id in ADAPTERS:
            manager.add_adapter(adapter_weights(manager, lora_id, base.model.embedding_modules))
            manager.activate_adapter(lora_id)
        # vLLM's profile run maps every token slot first (`_dummy_run(max_num_tokens)`: its requests
        # share the tokens evenly, `maybe_select_dummy_loras` gives them the adapters in turn): the
        # wrapper's buffers hold valid ids past any step's own tokens, which graphs padded beyond it read
        tokens = scheduler.max_num_batched_tokens
        requests = min(tokens, scheduler.max_num_seqs)
        per_request = [tokens // requests] * (requests - 1) + [tokens - tokens // requests * (requests - 1)]
        warm_up = LoraStep(per_request, per_request, [ADAPTERS[i % len(ADAPTERS)] for i in range(requests)])
        manager.set_adapter_mapping(warm_up.mapping())
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(real.Model)}
    return LoraModel(**fields, manager=manager)


def compiled_and_eager(monkeypatch: Any, where: Path, options: dict | None = None, max_loras: int = len(ADAPTERS),
                       max_lora_rank: int = RANK, **config: Any) -> list[LoraModel]:
    """The LoRA model built twice (seed 3) under `where` by `vllm_real.compiled_and_eager`: the first
    compiled through vLLM's mode-1 call (after the LoRA wrapping, as `load_model` does), the second eager."""
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank)
    return real.compiled_and_eager(monkeypatch, where, build, None, options, lora_config=lora, **config)


@dataclasses.dataclass
class LoraStep(real.Step):
    """A `vllm_real.Step` with each request's adapter id (0: none)."""

    adapters: Sequence[int] = ()

    def mapping(self) -> LoRAMapping:
        """vLLM's `LoRAMapping` as `LoRAModelRunnerMixin._set_active_loras` makes it: the per-token ids
        (`index_mapping`), one per request's sampled token (`prompt_mapping`), `is_prefill=True`."""
        adapters = list(self.adapters) or [0] * len(self.seq_lens)
        tokens = tuple(a for a, q in zip(adapters, self.query_lens) for _ in range(q))
        return LoRAMapping(tokens, tuple(adapters), is_prefill=True)


def run(model: LoraModel, step: LoraStep) -> torch.Tensor:
    """One step: its adapter mapping set, then `vllm_real.run`."""
    model.set_mapping(step)
    return real.run(model, step)
