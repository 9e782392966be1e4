"""The planning context the graph memory estimate rewrites against (`integrations/vllm/planning_context.py`),
without vLLM: vLLM's layers seen with fake one-block caches in the layout the binder splits, one metadata
object and slot mapping per KV-cache group, with the fields each backend's rewrite reads. Milliseconds a
test (the module's mutation selection, `tools/mutation/modules.toml`)."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ascend_compile.integrations.vllm import planning_context

NS = types.SimpleNamespace


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="ascend_compile")
    return caplog


# -------------------------------------------------------------------------------------- planning_context.py


class _Backend:
    def __init__(self, writes_cache):
        if writes_cache is not None:
            self.forward_includes_kv_cache_update = writes_cache


class _Layer:
    def __init__(self, spec="spec", heads=2, head_size=8, writes_cache=False, mla=None):
        self.spec, self.num_kv_heads, self.head_size = spec, heads, head_size
        self.attn_backend, self.kv_cache, self.scale = _Backend(writes_cache), "the layer's own", 0.5
        if mla is not None:
            self.kv_lora_rank, self.qk_rope_head_dim = mla

    def get_kv_cache_spec(self, vllm_config):
        if isinstance(self.spec, Exception):
            raise self.spec
        return self.spec


def _vllm_config(layers, block_size=16, dtype=torch.float16):
    return NS(cache_config=NS(block_size=str(block_size)), model_config=NS(dtype=dtype),
              compilation_config=NS(static_forward_context=layers))


def _context(layers, names=None, max_blocks=5, **kwargs):
    mode = FakeTensorMode()
    return planning_context.planning_context(list(names or layers), _vllm_config(layers, **kwargs),
                                             torch.device("cpu"), mode, max_blocks), mode


def _shape(t):
    return tuple(t.shape), t.dtype


def test_each_layer_is_seen_with_a_fake_one_block_cache_of_its_layout_and_is_otherwise_itself():
    layers = {"a": _Layer(heads=2, head_size=8), "m": _Layer(spec="mla", mla=(12, 4))}
    context, mode = _context(layers, block_size=32)
    a, m = context.no_compile_layers["a"], context.no_compile_layers["m"]
    assert isinstance(a.kv_cache, FakeTensor) and a.kv_cache.fake_mode is mode
    assert _shape(a.kv_cache) == ((1, 2, 32, 2, 8), torch.float16)
    assert _shape(m.kv_cache) == ((1, 32, 16), torch.float16)
    assert a.scale == 0.5 and a.head_size == 8 and layers["a"].kv_cache == "the layer's own"
    assert set(context.no_compile_layers) == {"a", "m"}


def test_only_the_named_layers_are_in_the_context():
    layers = {"a": _Layer(), "b": _Layer()}
    context, _ = _context(layers, names=["b"])
    assert list(context.no_compile_layers) == list(context.attn_metadata) == list(context.slot_mapping) == ["b"]


class _Spec:
    """vLLM's `KVCacheSpec`: a frozen dataclass (hashable, equal by value), with the cache's dtype."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __hash__(self):
        return hash(self.dtype)

    def __eq__(self, other):
        return isinstance(other, _Spec) and other.dtype == self.dtype


def test_the_caches_dtype_is_the_specs_else_the_models():
    layers = {"a": _Layer(spec=_Spec(torch.bfloat16)), "b": _Layer(spec=_Spec(None)), "c": _Layer(spec="s")}
    context, _ = _context(layers, dtype=torch.float32)
    assert [context.no_compile_layers[n].kv_cache.dtype for n in "abc"] == [torch.bfloat16, torch.float32,
                                                                            torch.float32]


def test_layers_of_one_spec_share_a_metadata_object_and_slot_mapping_as_vllm_groups_them():
    layers = {"a": _Layer(spec="full"), "b": _Layer(spec="sliding"), "c": _Layer(spec="full"),
              "d": _Layer(spec=TypeError("unhashable")), "e": _Layer(spec=TypeError("unhashable"))}
    context, _ = _context(layers)
    meta, slots = context.attn_metadata, context.slot_mapping
    assert meta["a"] is meta["c"] and slots["a"] is slots["c"]
    assert len({id(meta[n]) for n in "abde"}) == 4 and len({id(slots[n]) for n in "abde"}) == 4  # each its own
    assert all(_shape(slots[n]) == ((1,), torch.int64) for n in "abcde")


def test_a_layer_whose_spec_is_not_hashable_is_a_group_of_its_own():
    layers = {"a": _Layer(spec=NS(dtype=torch.bfloat16)), "b": _Layer(spec=NS(dtype=torch.bfloat16))}
    context, _ = _context(layers, dtype=torch.float32)
    assert context.attn_metadata["a"] is not context.attn_metadata["b"]
    assert context.no_compile_layers["a"].kv_cache.dtype == torch.float32  # the spec not read: the model's dtype
    unhashable = _Layer(spec=NS(dtype=None))
    assert planning_context._spec(unhashable, None) == id(unhashable)


def test_a_layers_spec_is_asked_with_vllms_config_and_a_failing_one_is_its_own_group():
    config, layer = object(), _Layer()
    seen = []
    layer.get_kv_cache_spec = lambda c: seen.append(c) or "spec"
    assert planning_context._spec(layer, config) == "spec" and seen == [config]
    failing = _Layer(spec=RuntimeError("no spec"))
    assert planning_context._spec(failing, config) == id(failing)


def test_flash_attention_metadata_is_one_request_with_a_max_blocks_wide_table():
    context, _ = _context({"a": _Layer(writes_cache=False)}, max_blocks=7)
    meta = context.attn_metadata["a"]
    assert sorted(vars(meta)) == ["block_table", "num_actual_tokens", "query_start_loc", "seq_lens"]
    assert meta.num_actual_tokens == 1
    assert [_shape(meta.seq_lens), _shape(meta.query_start_loc), _shape(meta.block_table)] == [
        ((1,), torch.int32), ((2,), torch.int32), ((1, 7), torch.int32)]


@pytest.mark.parametrize("writes_cache", [True, None])  # vLLM-Ascend's backends; a backend not saying: the same
def test_a_backend_writing_the_cache_in_its_op_gets_vllm_ascends_metadata(writes_cache):
    context, _ = _context({"a": _Layer(writes_cache=writes_cache)}, max_blocks=3)
    meta = context.attn_metadata["a"]
    assert sorted(vars(meta)) == ["block_tables", "num_actual_tokens", "query_start_loc", "seq_lens", "slot_mapping"]
    assert meta.num_actual_tokens == 1
    assert [_shape(meta.seq_lens), _shape(meta.query_start_loc), _shape(meta.block_tables),
            _shape(meta.slot_mapping)] == [((1,), torch.int32), ((2,), torch.int32), ((1, 3), torch.int32),
                                           ((1,), torch.int64)]


def test_mla_metadata_is_one_decode_and_no_prefill():
    context, _ = _context({"m": _Layer(mla=(8, 8))}, max_blocks=4)
    meta = context.attn_metadata["m"]
    assert (meta.num_reqs, meta.num_decodes, meta.num_prefills, meta.num_actual_tokens, meta.prefill) == (
        1, 1, 0, 1, None)
    assert _shape(meta.query_start_loc) == ((2,), torch.int32)
    assert sorted(vars(meta.decode)) == ["block_table", "seq_lens"]
    assert [_shape(meta.decode.seq_lens), _shape(meta.decode.block_table)] == [((1,), torch.int32),
                                                                                 ((1, 4), torch.int32)]


def test_the_planning_context_allocates_nothing_real():
    context, _ = _context({"a": _Layer(), "b": _Layer(writes_cache=True, spec="other")})
    tensors = [context.no_compile_layers["a"].kv_cache, context.slot_mapping["a"], context.attn_metadata["b"].slot_mapping,
               context.attn_metadata["a"].block_table, context.attn_metadata["b"].block_tables]
    assert all(isinstance(t, FakeTensor) and t.device == torch.device("cpu") for t in tensors)


def test_the_fakes_are_on_the_device_asked_and_each_spec_asked_of_vllms_config():
    layers = {"a": _Layer(), "m": _Layer(mla=(8, 8), writes_cache=True)}
    config, asked = _vllm_config(layers), []
    for name, layer in layers.items():
        layer.get_kv_cache_spec = lambda c, name=name: asked.append(c) or f"{name}'s spec"
    context = planning_context.planning_context(["a", "m"], config, torch.device("meta"), FakeTensorMode(), 3)
    tensors = [context.no_compile_layers["a"].kv_cache, context.no_compile_layers["m"].kv_cache,
               context.slot_mapping["a"], context.attn_metadata["a"].seq_lens, context.attn_metadata["m"].decode.seq_lens]
    assert all(t.device == torch.device("meta") for t in tensors)
    assert asked == [config, config]
