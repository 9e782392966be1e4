"""`ascend_graph` inside vLLM and vLLM-Ascend: their real attention ops, metadata from the forward context.

vLLM's model graphs call `vllm::unified_attention_with_output(query, key, value, output, layer_name,
...)` and, where the attention backend does not write the cache itself (FLASH_ATTN),
`vllm::unified_kv_cache_update(key, value, layer_name)`. Both take only a layer name: the metadata,
the layer and its KV cache come from `get_forward_context()`. This package's binder rewrites both
ops onto `ascend.reshape_and_cache` / `ascend.attention` and makes every value they read a provided
input, read from the forward context once per step (`binder.py`); MLA layers' ops onto
`ascend.mla_attention` / `ascend.mla_cache_write` (`mla.py`).

Plug it in with `backend(...)` (see `docs/vllm.md`): vLLM's stock-torch.compile mode takes it by
qualified name, `compilation_config={"mode": 1, "backend": "ascend_compile.integrations.vllm.vllm_backend",
"cudagraph_mode": "NONE"}`; vLLM-Ascend through the plug-in (`ascend_plugin.py`). Checked against
vLLM 0.23.0 and 0.33.0 / vLLM-Ascend 0.23.0.post1 (`releases.SUPPORTED`); tests run on vLLM's own
code (`tests/vllm_real.py`, `tests/vllm_mla_real.py`) and a stand-in with the pinned source's schemas
and names (`tests/vllm_standin.py`).

One module a job, each importing only those listed before it (no cycle):

- `context.py`: what is read from a forward context (a layer's key and value caches, cut metadata,
  whether the step asks for other than causal attention, whether a KV connector is set);
- `fast_path.py`: the direct dispatcher in front of the `Module.compile`d model, and the guard
  policy that says why it may stand in for dynamo's guards there;
- `options.py`: the backend's options from vLLM's config, `ASCEND_COMPILE_OPTIONS` over them;
- `releases.py`: the supported vLLM releases and the check of the installed one;
- `layers.py` (context): which attention layers are served, with which features, the rest refused;
- `metadata.py` (context): a metadata group's provided inputs and vLLM-Ascend's host lengths;
- `planning_context.py`: a forward context of vLLM's layers with stand-in metadata and caches (fakes);
- `memory.py` (planning_context): our graphs' memory, estimated at vLLM's profiling run (the graph's
  binder rewriting a copy against that context) and measured after each capture;
- `kv_budget.py` (memory): that figure taken out of the KV-cache budget of the worker class vLLM runs;
- `mla.py` (context, layers): the MLA ops' rewrite and refusals;
- `deferred.py` (fast_path, memory): as traced until a step can be compiled against, its binder a protocol;
- `binder.py` (context, layers, metadata, mla): `ForwardContextBinder` and finding vLLM's op nodes;
- `dynamo_backend.py` (binder, deferred, kv_budget, mla, options, releases): `backend`, `configured_backend`,
  `vllm_backend`;
- `drafter.py` (dynamo_backend, options): the drafter vLLM loads for speculative decoding, compiled beside the
  target with a backend of its own;
- `ascend_plugin.py` (options; `drafter`, `dynamo_backend` when it compiles): vLLM-Ascend's plug-in, the
  `vllm.general_plugins` entry point.

The names below are re-exported for `from ascend_compile.integrations.vllm import ...`; a test
patching one patches the module that looks it up (`releases.installed_version`,
`dynamo_backend.backend`, ...), not this package. No module imports vLLM at import time: vLLM is
imported inside the functions that read it.
"""
from __future__ import annotations

from typing import Any

from . import drafter, dynamo_backend, fast_path, options
from .binder import ATTENTION_OP, CACHE_UPDATE_OP, ForwardContextBinder, vllm_graph_nodes
from .deferred import DeferredCompile
from .drafter import compile_drafter, compile_runner_drafter
from .dynamo_backend import backend, configured_backend
from .layers import UnsupportedAttention
from .releases import SUPPORTED, installed_version

__all__ = ["ATTENTION_OP", "CACHE_UPDATE_OP", "SUPPORTED", "DeferredCompile", "ForwardContextBinder",
           "UnsupportedAttention", "backend", "compile_drafter", "compile_runner_drafter", "configured_backend",
           "installed_version", "vllm_graph_nodes"]


def __getattr__(name: str) -> Any:
    """`vllm_backend`, the name vLLM's `compilation_config.backend` gives
    ("ascend_compile.integrations.vllm.vllm_backend"): made at each lookup, from the vLLM config
    current then (`dynamo_backend.__getattr__`); with a drafter, vLLM's GPU runner is made to compile
    it before its first forward (`drafter.install`)."""
    if name == "vllm_backend":
        compile_fn = dynamo_backend.vllm_backend
        drafter.install(options.current_vllm_config())  # vLLM's GPU runner: its drafter compiled too
        return compile_fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
