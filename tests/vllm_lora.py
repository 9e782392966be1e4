"""vLLM's own multi-LoRA serving (0.23.0 or 0.33.0) on the tiny Llama of `tests/vllm_real.py`, on the CPU.

What vLLM's `GPUModelRunner` does with `--enable-lora`, by vLLM's own code: a `LoRAConfig` in the
`VllmConfig`; `load_model` wraps the loaded model with vLLM's LoRA layers
(`LoRAModelRunnerMixin.load_lora_model` -> `vllm.lora.model_manager.create_lora_manager`) before it
compiles it; adapters are added and activated into the layers' stacked weights
(`LoRAModelManager.add_adapter` / `activate_adapter`: `lora_a_stacked` `[max_loras, 1, rank, in]`,
`lora_b_stacked` `[max_loras, 1, out, rank]`); before each step `set_active_loras` gives the
per-token and per-request adapter mapping (`LoRAMapping(..., is_prefill=True)`,
`set_adapter_mapping`, which fills the punica wrapper's index buffers). The punica ops are vLLM's
pure-torch ones (`PunicaWrapperCPU`, which `CpuFlashAttnPlatform.get_punica_wrapper` names). The
adapters' weights are seeded random (`create_dummy_lora`, then filled), the same in the compiled
and the eager copy of the model.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any, Sequence

import torch

from tests import vllm_real as real

from vllm.config import (CacheConfig, CompilationConfig, LoRAConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
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

#: The adapters every model gets: vLLM's LoRA ids (0 is "no adapter").
ADAPTERS = (1, 2)
RANK = 8


def vllm_config(model_dir: Path, compile_mode: int = 0, max_model_len: int = 256, block_size: int = 16,
                max_loras: int = len(ADAPTERS), max_lora_rank: int = RANK) -> VllmConfig:
    """`vllm_real.vllm_config`'s config with a `LoRAConfig` (the same fields in 0.23 and 0.33:
    `max_loras`, `max_lora_rank`, `lora_dtype`), as `--enable-lora --max-loras 2` gives it."""
    (model_dir / "config.json").write_text(json.dumps(real.TINY_LLAMA))
    model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=max_model_len)
    compilation = CompilationConfig(mode=compile_mode, custom_ops=["none"], cudagraph_mode="NONE",
                                    **({"backend": real.BACKEND} if compile_mode == 1 else {}))
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                      scheduler_config=SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
                      compilation_config=compilation,
                      lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank))


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


def build(config: VllmConfig, seed: int = 0, num_blocks: int = 64) -> LoraModel:
    """`vllm_real.build`'s model wrapped by vLLM's LoRA manager (as `load_model` does before it compiles),
    with the adapters `ADAPTERS` added and activated."""
    base = real.build(config, seed, num_blocks)
    scheduler = config.scheduler_config
    with set_current_vllm_config(config):
        manager = create_lora_manager(base.model, max_num_seqs=scheduler.max_num_seqs,
                                      max_num_batched_tokens=scheduler.max_num_batched_tokens,
                                      vocab_size=config.model_config.get_vocab_size(),
                                      lora_config=config.lora_config, vllm_config=config, device=torch.device("cpu"))
        for lora_id in ADAPTERS:
            manager.add_adapter(adapter_weights(manager, lora_id, base.model.embedding_modules))
            manager.activate_adapter(lora_id)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(real.Model)}
    return LoraModel(**fields, manager=manager)


def compiled_and_eager(monkeypatch: Any, where: Path, options: dict | None = None, **config: Any) -> list[LoraModel]:
    """The LoRA model built twice (seed 3) under `where`: the first compiled through vLLM's mode-1 call
    (after the LoRA wrapping, as `load_model` does), the second eager."""
    if options is not None:
        monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps(options))
    models = []
    for mode in (1, 0):
        path = where / f"lora_mode{mode}"
        path.mkdir(exist_ok=True)
        models.append(build(vllm_config(path, compile_mode=mode, **config), seed=3))
    real.compile_as_vllm(models[0])
    return models


@dataclasses.dataclass
class LoraStep(real.Step):
    """A `vllm_real.Step` with each request's adapter id (0: none)."""

    adapters: Sequence[int] = ()

    def mapping(self) -> LoRAMapping:
        """vLLM's `LoRAMapping` as `LoRAModelRunnerMixin._set_active_loras` makes it: the per-token ids
        (`index_mapping`), one per request's sampled token (`prompt_mapping`), `is_prefill=True`."""
        adapters = list(self.adapters) or [0] * len(self.seq_lens)
        tokens = tuple(a for a, q in zip(adapters, self.query_lens) for _ in range(q))
        return LoRAMapping(tokens, tuple(adapters), is_prefill=False)


def run(model: LoraModel, step: LoraStep) -> torch.Tensor:
    """One step: its adapter mapping set, then `vllm_real.run`."""
    model.set_mapping(step)
    return real.run(model, step)
