"""A stand-in for vLLM's attention ops and forward context, faithful where an integration looks.

vLLM cannot run here, and tests never import it. What this module copies from vLLM 0.23.0 (and
vLLM-Ascend 0.23.0.post1), checked against `tests/fixtures/vllm_0_23_0.json` by
`tests/test_vllm_fixture.py`:

- the ops `torch.ops.vllm.unified_attention_with_output` and `torch.ops.vllm.unified_kv_cache_update`,
  defined in the `vllm` library with the schema `torch.library.infer_schema` gives for Python functions
  of the same signature (as vLLM's `direct_register_custom_op` does), `layer_name` a `str` or, as vLLM
  on torch >= 2.11 with `VLLM_USE_LAYERNAME=1`, the opaque `vllm.utils.torch_utils.LayerName`;
- `ForwardContext` with vLLM's field names, `get_forward_context`, `set_forward_context`,
  `override_forward_context`, `create_forward_context` with vLLM's parameters, and
  `get_attention_context` reading `attn_metadata[layer_name]`, `no_compile_layers[layer_name]`,
  the layer's `kv_cache` and `slot_mapping[layer_name]` as vLLM does;
- an `Attention` layer whose `forward` calls the ops as vLLM's does (`output = torch.empty(...)`, the
  cache update op where the backend's `forward_includes_kv_cache_update` is False, then the attention
  op with the layer name and `kv_cache_dummy_dep=`), registering itself in
  `vllm_config.compilation_config.static_forward_context[prefix]`, its cache bound as `layer.kv_cache`;
- two backends: vLLM's FLASH_ATTN (`FlashAttentionMetadata`, one `[num_blocks, 2, block_size, KVH, D]`
  cache per layer, a separate cache-update op fed by `forward_context.slot_mapping[layer_name]`) and
  vLLM-Ascend's (`AscendMetadata` with host lists `seq_lens_list` / `actual_seq_lengths_q`, a
  `(key_cache, value_cache)` pair per layer, the cache write inside the attention op from
  `attn_metadata.slot_mapping`).

The kernels are this project's reference ops (`torch.ops.ascend.*`), not vLLM's. See
`docs/vllm_research.md` for what the stand-in does not reproduce.
"""
import contextlib
import dataclasses
import enum
import json
import types
from pathlib import Path
from typing import Any

import torch

import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_compile.ops import tiling
from tests.helpers import write_flash_kv_cache

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0_23_0.json"
VLLM_VERSION = "0.23.0"
OP_NAMES = ("unified_kv_cache_update", "unified_attention_with_output")


def load_fixture() -> dict:
    return json.loads(FIXTURE.read_text())


# ---------------------------------------------------------------- layer names (vllm/utils/torch_utils.py)

try:
    from torch._opaque_base import OpaqueBase
    from torch._library.opaque_object import register_opaque_type
except ImportError:  # torch < 2.11: vLLM passes layer names as str
    OpaqueBase, register_opaque_type = object, None


class LayerName(OpaqueBase):
    """vLLM's `LayerName`: a layer name wrapped as a hoisted value-type opaque object."""

    def __init__(self, value: str):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, LayerName) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"LayerName({self.value!r})"

    def __fx_repr__(self):
        return (f"LayerName({self.value!r})", {"LayerName": LayerName})


# The opaque type's schema name is the class's module and qualname: vLLM's.
LAYER_NAME_TYPE = "vllm.utils.torch_utils.LayerName"
LayerName.__module__ = LAYER_NAME_TYPE.rsplit(".", 1)[0]
HAS_OPAQUE_TYPE = register_opaque_type is not None
if HAS_OPAQUE_TYPE:
    register_opaque_type(LayerName, typ="value", hoist=True)


def _resolve_layer_name(layer_name) -> str:
    return layer_name.value if isinstance(layer_name, LayerName) else layer_name


def _encode_layer_name(layer_name: str):
    return LayerName(layer_name) if _state.layer_name_type == "LayerName" else layer_name


# ---------------------------------------------------------------- config and forward context (vllm/forward_context.py)


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclasses.dataclass
class CompilationConfig:
    static_forward_context: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class VllmConfig:
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)


@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    slot_mapping: Any
    dp_metadata: Any = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: Any = None
    ubatch_slices: Any = None
    skip_compiled: bool = False
    all_moe_layers: list[str] | None = None
    moe_layer_index: int = 0
    additional_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward context."
    )
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


def create_forward_context(attn_metadata, vllm_config, dp_metadata=None, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                           batch_descriptor=None, ubatch_slices=None, slot_mapping=None, additional_kwargs=None,
                           skip_compiled=False) -> ForwardContext:
    return ForwardContext(
        no_compile_layers=vllm_config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping or {},
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
        skip_compiled=skip_compiled,
        additional_kwargs=additional_kwargs or {},
    )


@contextlib.contextmanager
def override_forward_context(forward_context):
    global _forward_context
    prev = _forward_context
    _forward_context = forward_context
    try:
        yield
    finally:
        _forward_context = prev


@contextlib.contextmanager
def set_forward_context(attn_metadata, vllm_config, num_tokens=None, num_tokens_across_dp=None,
                        cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None, ubatch_slices=None,
                        slot_mapping=None, skip_compiled=False):
    forward_context = create_forward_context(attn_metadata, vllm_config, None, cudagraph_runtime_mode,
                                             batch_descriptor, ubatch_slices, slot_mapping, None, skip_compiled)
    with override_forward_context(forward_context):
        yield


def get_attention_context(layer_name: str):
    """vLLM's `get_attention_context`: (attn_metadata, layer, kv_cache, the layer's slot mapping)."""
    forward_context = get_forward_context()
    raw = forward_context.attn_metadata
    if isinstance(raw, dict):
        attn_metadata = raw[layer_name]
    elif isinstance(raw, list):
        attn_metadata = raw[0][layer_name]
    else:
        attn_metadata = raw
    attn_layer = forward_context.no_compile_layers[layer_name]
    kv_cache = attn_layer.kv_cache
    slot_mapping = forward_context.slot_mapping
    assert isinstance(slot_mapping, dict), f"Expected slot_mapping to be a dict, got {type(slot_mapping)}. "
    return attn_metadata, attn_layer, kv_cache, slot_mapping.get(layer_name)


# ---------------------------------------------------------------- the ops (vllm/model_executor/layers/attention/attention.py)


def unified_kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer_name = _resolve_layer_name(layer_name)
    _, attn_layer, kv_cache, layer_slot_mapping = get_attention_context(layer_name)
    if layer_slot_mapping is not None:
        assert hasattr(attn_layer.impl, "do_kv_cache_update"), (
            f"{attn_layer.impl.__class__.__name__} does not support kv cache update"
        )
        attn_layer.impl.do_kv_cache_update(attn_layer, key, value, kv_cache, layer_slot_mapping)
    return torch.empty(0, device=kv_cache.device, dtype=kv_cache.dtype)


def unified_kv_cache_update_fake(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty(0, device=key.device, dtype=key.dtype)


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
    output_block_scale: torch.Tensor | None = None,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    del kv_cache_dummy_dep
    layer_name = _resolve_layer_name(layer_name)
    attn_metadata, self, kv_cache, _ = get_attention_context(layer_name)
    self.impl.forward(self, query, key, value, kv_cache, attn_metadata, output=output, output_scale=output_scale,
                      output_block_scale=output_block_scale)


def unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
    output_block_scale: torch.Tensor | None = None,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    return


#: (op function, fake, mutates_args) exactly as vLLM's direct_register_custom_op calls.
_OPS = {
    "unified_kv_cache_update": (unified_kv_cache_update, unified_kv_cache_update_fake, []),
    "unified_attention_with_output": (unified_attention_with_output, unified_attention_with_output_fake,
                                      ["output", "output_block_scale"]),
}


def _with_layer_name_type(fn, typ):
    """A copy of `fn` whose `layer_name` parameter is annotated `typ` (vLLM's `LayerNameType`)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__annotations__ = {**fn.__annotations__, "layer_name": typ}
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class _State:
    lib: torch.library.Library | None = None
    layer_name_type: str | None = None
    defined: dict[str, str] = {}


_state = _State()


_STUB_MODULES = ("vllm", "vllm.utils", "vllm.utils.torch_utils")


def _module_stub(install: bool) -> None:
    """Dynamo hoists a `LayerName` argument by importing its class from its module, so with opaque
    layer names `vllm.utils.torch_utils` must import: stub modules holding only `LayerName` (marked
    `VLLM_STANDIN = True`) stand in while the LayerName ops are registered, never over a real vLLM."""
    import importlib.util
    import sys

    if install:
        if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None:
            raise RuntimeError("a real vllm is installed; the stand-in will not shadow it")
        for name in _STUB_MODULES:
            module = sys.modules.get(name)
            if module is None:
                module = sys.modules[name] = types.ModuleType(name)
                module.VLLM_STANDIN = True
            elif not getattr(module, "VLLM_STANDIN", False):
                raise RuntimeError(f"{name} is a real module; the stand-in will not shadow it")
        sys.modules["vllm"].utils = sys.modules["vllm.utils"]
        sys.modules["vllm.utils"].torch_utils = sys.modules["vllm.utils.torch_utils"]
        sys.modules["vllm.utils.torch_utils"].LayerName = LayerName
    else:
        for name in _STUB_MODULES:
            if getattr(sys.modules.get(name), "VLLM_STANDIN", False):
                del sys.modules[name]


def register(layer_name_type: str = "str", dispatch_keys=("CPU", "CUDA")) -> None:
    """Define the `vllm` ops as vLLM's `direct_register_custom_op` does; `layer_name_type` is `str`
    (vLLM-Ascend 0.23 on torch 2.10; vLLM on torch < 2.11 or `VLLM_USE_LAYERNAME=0`) or `LayerName`
    (vLLM 0.23 on torch >= 2.11 by default). Redefines them when the type changes."""
    if layer_name_type not in ("str", "LayerName"):
        raise ValueError(f"layer_name_type: expected 'str' or 'LayerName', got {layer_name_type!r}")
    if layer_name_type == "LayerName" and not HAS_OPAQUE_TYPE:
        raise RuntimeError(f"torch {torch.__version__} has no opaque types; vLLM uses str layer names there")
    if _state.lib is not None:
        if _state.layer_name_type == layer_name_type:
            return
        _state.lib._destroy()
    _module_stub(layer_name_type == "LayerName")
    typ = str if layer_name_type == "str" else LayerName
    lib = torch.library.Library("vllm", "FRAGMENT")
    defined = {}
    for name, (fn, fake, mutates) in _OPS.items():
        fn, fake = _with_layer_name_type(fn, typ), _with_layer_name_type(fake, typ)
        schema = torch.library.infer_schema(fn, mutates_args=mutates)
        lib.define(name + schema)
        for key in dispatch_keys:
            lib.impl(name, fn, dispatch_key=key)
        lib._register_fake(name, fake)
        defined[f"vllm::{name}"] = schema
    _state.lib, _state.layer_name_type, _state.defined = lib, layer_name_type, defined


def defined_schemas() -> dict[str, str]:
    """The schema string each stand-in op was defined with (what vLLM passes to `Library.define`),
    without the op name: `(Tensor key, Tensor value, str layer_name) -> Tensor`."""
    return dict(_state.defined)


def registered_schemas() -> dict[str, str]:
    """The schema of each op as torch holds it now, without the op name. Torch prints an opaque
    type as `PyObject` here, where the defined string names it."""
    out = {}
    for name in OP_NAMES:
        schema = str(getattr(torch.ops.vllm, name).default._schema)
        prefix = f"vllm::{name}"
        assert schema.startswith(prefix), schema
        out[prefix] = schema[len(prefix):]
    return out


def as_registered(schema: str) -> str:
    """A defined schema string as torch prints the registered schema (opaque types as `PyObject`)."""
    return schema.replace(LAYER_NAME_TYPE + " ", "PyObject ")


def check_against_fixture(schemas: dict[str, str] | None = None, layer_name_type: str | None = None,
                          fixture: dict | None = None) -> None:
    """Raise AssertionError naming the op, the expected and the actual schema where `schemas`
    (default: the stand-in's defined ones) differ from vLLM's as the fixture records them."""
    fixture = fixture or load_fixture()
    schemas = defined_schemas() if schemas is None else schemas
    layer_name_type = layer_name_type or _state.layer_name_type
    key = "schema_str_layer_name" if layer_name_type == "str" else "schema_opaque_layer_name"
    problems = []
    for qualname, entry in fixture["ops"].items():
        expected = entry[key]
        actual = schemas.get(qualname)
        if actual != expected:
            problems.append(
                f"{qualname}: schema differs from vLLM {fixture['source']['vllm']['version']}'s "
                f"({FIXTURE.name}, registered at {entry['registered_at']}, layer_name as {layer_name_type})\n"
                f"  expected: {qualname}{expected}\n"
                f"  actual:   {qualname}{actual if actual is not None else ' (not registered)'}"
            )
    if problems:
        raise AssertionError("\n".join(problems))


# ---------------------------------------------------------------- backends


class AttentionType:
    DECODER = "decoder"


class AttentionBackend:
    forward_includes_kv_cache_update: bool = True


@dataclasses.dataclass
class FlashAttentionMetadata:
    """vLLM's FLASH_ATTN metadata (vllm/v1/attention/backends/flash_attn.py)."""
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    use_cascade: bool
    common_prefix_len: int
    cu_prefix_query_lens: torch.Tensor | None
    prefix_kv_lens: torch.Tensor | None
    suffix_kv_lens: torch.Tensor | None
    max_dcp_context_kv_len: int | None = None
    dcp_context_kv_lens: torch.Tensor | None = None
    scheduler_metadata: torch.Tensor | None = None
    prefix_scheduler_metadata: torch.Tensor | None = None
    max_num_splits: int = 0
    causal: bool = True


def _attention_impl_init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **kwargs):
    self.num_heads = num_heads
    self.head_size = head_size
    self.scale = float(scale)
    self.num_kv_heads = num_kv_heads
    self.alibi_slopes = alibi_slopes
    self.sliding_window = sliding_window
    self.kv_cache_dtype = kv_cache_dtype
    self.logits_soft_cap = logits_soft_cap
    self.attn_type = attn_type
    self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
    self.num_queries_per_kv = num_heads // num_kv_heads
    self.sinks = kwargs.get("sinks")


def _attend(impl, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, output, num_tokens):
    """Paged attention of the first `num_tokens` query rows into `output[:num_tokens]` (the reference op),
    with the impl's window (FlashAttention's `window_size=(left, 0)` attends `left + 1` keys), soft-cap
    (0: none) and sinks, as `flash_attn_varlen_func` takes them."""
    left, right = impl.sliding_window
    assert right in (0, -1), "causal windows only"
    out = torch.ops.ascend.attention(query[:num_tokens], key_cache, value_cache, block_table, seq_lens,
                                     query_start_loc, impl.scale, window=left + 1 if left >= 0 else None,
                                     soft_cap=impl.logits_soft_cap or None, sinks=impl.sinks)
    output[:num_tokens] = out.to(output.dtype)


class FlashAttentionImpl:
    def __init__(self, *args, **kwargs):
        """As vLLM's: the window kept as `window_size` `(W - 1, 0)` ((-1, -1): none), the soft-cap as 0 for none."""
        _attention_impl_init(self, *args, **kwargs)
        self.sliding_window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
        self.logits_soft_cap = self.logits_soft_cap or 0

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        write_flash_kv_cache(key, value, *kv_cache.unbind(1), slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        assert output is not None, "Output tensor must be provided."
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not yet supported for FlashAttentionImpl")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(1)
        num_reqs = attn_metadata.seq_lens.shape[0]
        _attend(self, query, key_cache, value_cache, attn_metadata.block_table[:num_reqs], attn_metadata.seq_lens,
                attn_metadata.query_start_loc[: num_reqs + 1], output, num_actual_tokens)
        return output


class FlashAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls():
        return FlashAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


@dataclasses.dataclass
class AscendMetadata:
    """vLLM-Ascend's metadata (vllm_ascend/attention/attention_v1.py)."""
    attn_mask: torch.Tensor | None = None
    attn_state: AscendAttentionState = AscendAttentionState.ChunkedPrefill
    num_actual_tokens_pcp_padded: int = 0
    num_actual_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    seq_lens: torch.Tensor = None
    seq_lens_cpu: torch.Tensor = None
    seq_lens_list: list[int] = None
    actual_seq_lengths_q: list[int] = None
    query_start_loc: torch.Tensor = None
    max_query_len: int | None = None
    block_tables: torch.Tensor = None
    slot_mapping: torch.Tensor = None
    prefill: Any = None
    decode_meta: Any = None
    causal: bool = True
    model_runner_type: str = ""
    reshape_cache_event: Any = None
    kvcomp_metadata: Any = None


class AscendAttentionBackendImpl:
    """vLLM-Ascend's impl, eager path: the cache write from `attn_metadata.slot_mapping`, then FIA over the
    host lists `actual_seq_lengths_q` (cumulative query ends) and `seq_lens_list` (KV lengths)."""

    def __init__(self, *args, **kwargs):
        _attention_impl_init(self, *args, **kwargs)
        del self.logits_soft_cap  # vLLM-Ascend's impl does not keep it
        self.hidden_size = self.num_heads * self.head_size
        self.key_cache = None
        self.value_cache = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        assert output is not None, "Output tensor must be provided."
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not yet supported for AscendAttentionBackendImpl")
        if attn_metadata is None:
            return output.fill_(0)
        if self.key_cache is None and kv_cache is not None and len(kv_cache) >= 2:
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        if key is not None and value is not None:
            n = attn_metadata.num_actual_tokens
            # vLLM-Ascend's int32 slots, as torch_npu's cache write (and the reference op) takes them
            torch.ops.ascend.reshape_and_cache(key[:n], value[:n], self.key_cache, self.value_cache,
                                               attn_metadata.slot_mapping[:n])
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        query_lens = [e - s for s, e in zip([0] + attn_metadata.actual_seq_lengths_q[:-1],
                                            attn_metadata.actual_seq_lengths_q)]
        q = query[:num_tokens]
        shape = tiling.AttentionShape.of(q, self.key_cache)
        workspace = torch.empty(tiling.workspace_nbytes(tiling.FIA, shape, attn_metadata.seq_lens_list, query_lens),
                                dtype=torch.uint8, device=query.device)
        out = torch.empty_like(q)
        torch.ops.ascend.fused_infer_attention(q, self.key_cache, self.value_cache, attn_metadata.block_tables,
                                               attn_metadata.actual_seq_lengths_q, attn_metadata.seq_lens_list,
                                               self.scale, workspace, out, window=self.sliding_window,
                                               sinks=self.sinks)
        output[:num_tokens] = out
        return output


class AscendAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return AscendAttentionBackendImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=""):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


# The backends' classes under vLLM's and vLLM-Ascend's module paths: the integration knows a backend by class.
FlashAttentionBackend.__module__ = "vllm.v1.attention.backends.flash_attn"
AscendAttentionBackend.__module__ = "vllm_ascend.attention.attention_v1"
BACKENDS = {"FLASH_ATTN": FlashAttentionBackend, "ASCEND": AscendAttentionBackend}


# ---------------------------------------------------------------- the layer (Attention) and a model


class Attention(torch.nn.Module):
    """vLLM's `Attention` as far as the ops see it: the same constructor parameters (most unused), the
    same attributes for what it keeps, and the same `forward`."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, use_alibi_sqrt=None,
                 cache_config=None, quant_config=None, logits_soft_cap=None, per_layer_sliding_window=None,
                 prefix="", attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, attn_backend=None,
                 head_size_v=None, *, vllm_config: VllmConfig, **extra_impl_args):
        super().__init__()
        if num_kv_heads is None:
            num_kv_heads = num_heads
        assert num_heads % num_kv_heads == 0
        self.kv_cache_dtype = "auto"
        self.layer_name = prefix
        self.num_heads = num_heads
        self.head_size = head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.num_kv_heads = num_kv_heads
        self.sliding_window = per_layer_sliding_window
        self.attn_backend = attn_backend or FlashAttentionBackend
        self.impl = self.attn_backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                                                     self.sliding_window, self.kv_cache_dtype, logits_soft_cap,
                                                     attn_type, kv_sharing_target_layer_name, **extra_impl_args)
        self.dtype = torch.get_default_dtype()
        compilation_config = vllm_config.compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache = torch.tensor([])  # replaced by bind_kv_cache

    def forward(self, query, key, value, output_shape=None):
        if output_shape is None:
            num_tokens = query.shape[0]
            output_shape = torch.Size((num_tokens, self.num_heads * self.head_size_v))
        output = torch.empty(output_shape, dtype=query.dtype, device=query.device)
        hidden_size = output_shape[-1]
        query = query.view(-1, self.num_heads, self.head_size)
        output = output.view(-1, self.num_heads, self.head_size_v)
        if key is not None:
            key = key.view(-1, self.num_kv_heads, self.head_size)
        if value is not None:
            value = value.view(-1, self.num_kv_heads, self.head_size_v)
        kv_cache_dummy_dep = None
        encoded = _encode_layer_name(self.layer_name)
        if (not self.attn_backend.forward_includes_kv_cache_update and self.kv_sharing_target_layer_name is None
                and key is not None and value is not None):
            kv_cache_dummy_dep = torch.ops.vllm.unified_kv_cache_update(key, value, encoded)
        torch.ops.vllm.unified_attention_with_output(query, key, value, output, encoded,
                                                     kv_cache_dummy_dep=kv_cache_dummy_dep)
        return output.view(-1, hidden_size)


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads, head_size, prefix, vllm_config, backend, **attention_options):
        super().__init__()
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.qkv_proj = torch.nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = torch.nn.Linear(self.q_size, hidden, bias=False)
        self.attn = Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads, prefix=f"{prefix}.self_attn.attn",
                              attn_backend=backend, vllm_config=vllm_config, **attention_options)

    def forward(self, hidden_states, positions=None):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if positions is not None:  # vLLM's rotary embedding: its query viewed by the positions' count
            angle = torch.cos(positions.float())[:, None, None]
            q = (q.view(positions.shape[0], -1, self.attn.head_size) * angle).reshape(q.shape)
        return hidden_states + self.o_proj(self.attn(q, k, v))


class StandInModel(torch.nn.Module):
    """A tiny decoder taking vLLM's model inputs (`input_ids`, `positions`); layers are named as vLLM's
    (`model.layers.{i}.self_attn.attn`). `attention_options`: extra `Attention` arguments per layer
    index (a sliding window, a soft-cap, ...)."""

    def __init__(self, vllm_config: VllmConfig, backend="FLASH_ATTN", num_layers=2, vocab=64, hidden=32,
                 num_heads=4, num_kv_heads=2, head_size=8, max_position=512, seed=0,
                 attention_options: dict[int, dict] | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.embed_positions = torch.nn.Embedding(max_position, hidden)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(hidden, num_heads, num_kv_heads, head_size, f"model.layers.{i}", vllm_config,
                         BACKENDS[backend], **(attention_options or {}).get(i, {}))
            for i in range(num_layers)
        )
        self.backend = backend

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        return h

    def attention_layers(self) -> dict[str, Attention]:
        return {layer.attn.layer_name: layer.attn for layer in self.layers}


class RotaryModel(StandInModel):
    """The stand-in with positions not embedded but, as in vLLM's Llama, only turning each layer's query,
    viewed as vLLM's rotary embedding views it: `query.view(positions.shape[0], -1, head_size)`, so
    nothing equates the positions' count with the ids' (a constant row stands for the position
    embedding: dynamo's restart diverges where the embedding's call is the whole first statement)."""

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids) + self.embed_positions.weight[0]
        for layer in self.layers:
            h = layer(h, positions)
        return h


def bind_kv_cache(model: StandInModel, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
    """Allocate each layer's cache in its backend's layout and bind it as `layer.kv_cache` (vLLM's
    `bind_kv_cache`; vLLM-Ascend binds a `(key_cache, value_cache)` pair)."""
    caches = {}
    for name, layer in model.attention_layers().items():
        shape = layer.attn_backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        if layer.attn_backend is AscendAttentionBackend:
            kv = (torch.zeros(shape[1:], dtype=dtype, device=device), torch.zeros(shape[1:], dtype=dtype, device=device))
        else:
            kv = torch.zeros(shape, dtype=dtype, device=device)
        layer.kv_cache = kv
        caches[name] = kv
    return caches


# ---------------------------------------------------------------- a step's metadata, as the model runners build it


@dataclasses.dataclass
class Step:
    """One batch: per request its KV length after this step and its number of new tokens."""
    seq_lens: list[int]
    query_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    block_size: int

    @property
    def query_start_loc(self) -> list[int]:
        loc = [0]
        for n in self.query_lens:
            loc.append(loc[-1] + n)
        return loc

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self) -> list[int]:
        return [p for s, q in zip(self.seq_lens, self.query_lens) for p in range(s - q, s)]

    def slot_mapping(self) -> torch.Tensor:
        slots = []
        for b, (s, q) in enumerate(zip(self.seq_lens, self.query_lens)):
            for p in range(s - q, s):
                slots.append(int(self.block_table[b, p // self.block_size]) * self.block_size + p % self.block_size)
        return torch.tensor(slots, dtype=torch.int64)


def build_metadata(model: StandInModel, step: Step, device="cpu", spare_reqs: int = 0):
    """(attn_metadata, slot_mapping) for `set_forward_context`: one metadata object shared by every layer
    (one KV-cache group), keyed by layer name, as vLLM's and vLLM-Ascend's runners build them.
    `spare_reqs`: `query_start_loc` and the block table are views of a runner's persistent buffers for
    that many more requests than `num_reqs`, the tail of `query_start_loc` holding the last offset and
    the spare block-table rows block 0."""
    names = list(model.attention_layers())
    qsl = torch.tensor(step.query_start_loc + step.query_start_loc[-1:] * spare_reqs, dtype=torch.int32)
    seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32)
    slots = step.slot_mapping().to(device)
    rows = len(step.seq_lens)
    block_table = torch.zeros(rows + spare_reqs, step.block_table.shape[1], dtype=torch.int32, device=device)
    block_table[:rows] = step.block_table
    if model.backend == "FLASH_ATTN":
        meta = FlashAttentionMetadata(
            num_actual_tokens=step.num_tokens, max_query_len=max(step.query_lens), query_start_loc=qsl.to(device),
            max_seq_len=max(step.seq_lens), seq_lens=seq_lens.to(device), block_table=block_table,
            slot_mapping=slots, use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
            prefix_kv_lens=None, suffix_kv_lens=None,
        )
        return {n: meta for n in names}, {n: slots for n in names}
    decode = all(q == 1 for q in step.query_lens)
    meta = AscendMetadata(
        attn_state=AscendAttentionState.DecodeOnly if decode else AscendAttentionState.ChunkedPrefill,
        num_actual_tokens=step.num_tokens,
        num_decode_tokens=sum(q for q in step.query_lens if q == 1),
        num_prefills=sum(q > 1 for q in step.query_lens), num_decodes=sum(q == 1 for q in step.query_lens),
        block_tables=block_table, query_start_loc=qsl.to(device), seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        seq_lens_list=list(step.seq_lens), actual_seq_lengths_q=step.query_start_loc[1:],
        max_query_len=max(step.query_lens), slot_mapping=slots.to(torch.int32),  # vLLM-Ascend's slots are int32
    )
    return {n: meta for n in names}, {}


register()
