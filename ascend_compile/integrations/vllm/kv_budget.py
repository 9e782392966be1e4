"""Our graphs' memory taken out of vLLM's KV-cache budget before vLLM sizes the cache.

vLLM's worker answers `determine_available_memory()` with the bytes the KV cache may take on its
rank, after its profiling run (`profile_run`, where dynamo hands our backend the model's graph);
the engine sizes every rank's cache from the smallest answer. That answer is where vLLM takes out
its own reservations (0.23 / 0.33 `vllm/v1/worker/gpu_worker.py`: the CUDA-graph estimate,
`reserve_mm_ipc_gpu_memory`), and where this module takes out ours: the worker class vLLM runs
(`parallel_config.worker_cls`: vLLM's `Worker`, vLLM-Ascend's `NPUWorker` and its subclasses) gets
its `determine_available_memory` wrapped, once, when our backend is configured in the worker
(`dynamo_backend.configured_backend`, during `load_model`, before the KV cache is sized). The wrapper,
after the original:

- estimates the graph memory of every graph the profiling run handed over (`memory.estimate`), or
  takes `ASCEND_COMPILE_GRAPH_MEMORY`'s bytes; an estimate that fails is logged (WARNING: set that
  variable) and reserves nothing, but a refusal (`ValueError`: a layer or an option the compile would
  refuse) fails start-up, as the compile would later;
- returns vLLM's figure unchanged where the user set `kv_cache_memory_bytes` (a warning says how much
  our graphs will take), or where vLLM 0.33 applied its startup plan (a plan saved under this
  wrapper already left our memory out);
- else takes it out of the returned figure and out of `available_kv_cache_memory_bytes`, adds it to
  `peak_activation_memory` (so vLLM's suggested `--kv-cache-memory` and 0.33's saved startup plan
  count it), and raises a `ValueError` naming it where nothing is left for the KV cache.

No device work: the figure is host arithmetic (`memory.py`).
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

from . import memory

log = logging.getLogger("ascend_compile")
_WRAPPED = "_ascend_compile_kv_budget"


def worker_class(vllm_config: Any) -> type | None:
    """The worker class vLLM runs (`parallel_config.worker_cls`), or None where it is not resolved."""
    name = getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None)
    if isinstance(name, type):
        return name
    if not isinstance(name, str) or "." not in name:
        return None
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        log.warning("ascend_compile: graph memory not reserved in vLLM's KV-cache budget: worker class %s does "
                    "not import (%s: %s)", name, type(err).__name__, err)
        return None


def install(vllm_config: Any) -> None:
    """Wrap the running worker class's `determine_available_memory` (once per class)."""
    cls = worker_class(vllm_config)
    if cls is None:
        log.info("ascend_compile: graph memory not reserved in vLLM's KV-cache budget: parallel_config.worker_cls "
                 "is not resolved (%r)", getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None))
        return
    wrap(cls)


def wrap(cls: type) -> None:
    """Make `cls.determine_available_memory` leave our graphs' memory out of its answer."""
    original: Callable[[Any], int] = cls.determine_available_memory
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        user_set, since = self.cache_config.kv_cache_memory_bytes, memory.handed_over()
        available = original(self)
        return reserve(self, int(available), user_set, memory.tracked(since))

    setattr(determine_available_memory, _WRAPPED, True)
    cls.determine_available_memory = determine_available_memory


def reserve(worker: Any, available: int, user_set: int | None, graphs: list[Any]) -> int:
    """`available` (vLLM's answer) less the memory of `graphs` (those its profiling run handed over),
    with the worker's bookkeeping kept consistent (see the module docstring)."""
    if not graphs:
        return available
    forced = memory.override()
    if forced is not None:
        nbytes, how = forced, f"{memory.ENV}={forced}"
        shares = [forced] * len(graphs)  # the user's figure bounds each
    else:
        try:
            estimates = [memory.estimate(g, worker.vllm_config) for g in graphs]
        except ValueError:  # a refusal (a layer, an option): the compile would fail the same, later
            raise
        except Exception as err:  # noqa: BLE001 - an estimate that fails must not fail vLLM's start-up
            log.warning("ascend_compile: no graph memory estimate (%s: %s)", type(err).__name__, err)
            estimates = [None]
        if any(e is None for e in estimates):
            log.warning("ascend_compile: graph memory not reserved in vLLM's KV-cache budget (no estimate, see "
                        "above): set %s to the bytes to reserve, or lower gpu_memory_utilization", memory.ENV)
            return available
        shares = [e.total for e in estimates]
        nbytes = sum(shares)
        how = "estimated: " + "; ".join(e.describe() for e in estimates)
    memory.reserved_once()
    for graph, share in zip(graphs, shares):  # compared with what its captures take (`memory.log_graph_memory`)
        graph.reserved = share
    if user_set:
        log.warning("ascend_compile: kv_cache_memory_bytes=%d is set: vLLM's KV cache is not reduced for our "
                    "graphs, which will take %.1f MiB more (%s)", user_set, nbytes / memory.MIB, how)
        return available
    if worker.cache_config.kv_cache_memory_bytes:
        log.info("ascend_compile: vLLM applied its startup plan (kv_cache_memory_bytes=%d), saved with our "
                 "graphs' %.1f MiB already left out", worker.cache_config.kv_cache_memory_bytes,
                 nbytes / memory.MIB)
        return available
    left = available - nbytes
    if left <= 0:
        raise ValueError(f"ascend_compile: our graphs need {nbytes} bytes ({how}) outside vLLM's KV-cache budget, "
                         f"but vLLM has only {available} bytes for the KV cache: raise gpu_memory_utilization, "
                         f"lower max_model_len or the capture sizes, or set {memory.ENV}")
    if hasattr(worker, "available_kv_cache_memory_bytes"):
        worker.available_kv_cache_memory_bytes -= nbytes
    if hasattr(worker, "peak_activation_memory"):
        worker.peak_activation_memory += nbytes
    log.info("ascend_compile: %.1f MiB taken out of vLLM's KV-cache budget for our graphs (%s): %.1f MiB left "
             "for the KV cache", nbytes / memory.MIB, how, left / memory.MIB)
    return left
