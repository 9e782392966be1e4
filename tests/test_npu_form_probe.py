"""The FIA form probe's contract (`ascend_compile/ops/npu/form_probe.py`): the calls it makes of a layer's form
(a decode call at one query token, without the band; a mixed call at two, in band mode where the layer is
windowed; FIA v2's bfloat16 sink where it has sinks; each its workspace query, then the kernel, on a one-block
cache), what it concludes (None where the device takes both; else the device's message, at the call refused,
and no call after it), and that it asks once per torch_npu module, device and form. Plain calls of a recording
device and of the fake torch_npu: mutmut's tests for this module (the compile's use of the answer is
`tests/test_npu_kernel_rules.py`'s)."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_compile.ops import tiling
from ascend_compile.ops.npu import band_probe, form_probe
from ascend_compile.ops.npu import kernels as npu_ops
from tests import fake_torch_npu, fake_torch_npu_sources as sources

SHAPE = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
BF16 = torch.bfloat16


class _Module:
    """A torch_npu module's stand-in: the probe keys its answers by it."""


class Device:
    """A device recording the probe's calls, refusing (a RuntimeError) the ones `refuse` names:
    ("workspace" | "launch", query tokens)."""

    def __init__(self, refuse=(), device="cpu"):
        self.torch_npu, self.device, self.refuse, self.calls = _Module(), torch.device(device), set(refuse), []

    def _call(self, what, query, *args):
        self.calls.append((what, query, *args))
        if (what, query.shape[0]) in self.refuse:
            raise RuntimeError(f"EZ9999: {what} refused")

    def band_workspace_nbytes(self, query, key_cache, value_cache, table, ends, kv_lens, scale, out, pre, sink):
        self._call("workspace", query, key_cache, value_cache, table, ends, kv_lens, scale, out, out, pre, sink)
        return 100 + query.shape[0]

    def launch_fia(self, query, key_cache, value_cache, table, ends, kv_lens, scale, workspace, out, pre, sink):
        self._call("launch", query, key_cache, value_cache, table, ends, kv_lens, scale, workspace, out, pre, sink)


def test_the_form_of_a_layer_is_its_heads_head_dim_dtype_block_size_window_and_sinks():
    assert form_probe.form_of(SHAPE, BF16, None, False) == (4, 2, 16, BF16, 128, False, False)
    assert form_probe.form_of(SHAPE, torch.float16, 0, 1) == (4, 2, 16, torch.float16, 128, True, True)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "windowed"])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_a_taken_form_is_asked_by_a_decode_and_a_mixed_call_each_its_workspace_query_then_the_kernel(window, sinks):
    device = Device()
    assert form_probe.refusal(device, SHAPE, BF16, window, sinks) is None
    assert [(c[0], c[1].shape[0]) for c in device.calls] == [("workspace", 1), ("launch", 1), ("workspace", 2),
                                                             ("launch", 2)]
    for what, query, key, value, table, ends, kv_lens, scale, third, out, pre, sink in device.calls:
        tokens = query.shape[0]
        assert query.shape == (tokens, 4, 16) and query.dtype == BF16 and query.device.type == "cpu"
        for cache in (key, value):
            assert cache.shape == (1, 128, 2, 16) and cache.dtype == BF16
        assert table.shape == (1, 1) and table.dtype == torch.int32 and int(table.sum()) == 0
        assert ends == [tokens] and kv_lens == [tokens] and scale == 1.0
        assert out.shape == query.shape and out.dtype == BF16
        # the band only at two query tokens (a windowed layer's S=1 band is the S=1 band probe's question)
        assert pre == (band_probe.PROBE_WINDOW - 1 if window is not None and tokens > 1 else None), (what, tokens)
        if sinks:
            assert sink.shape == (4,) and sink.dtype == BF16 and int(sink.abs().sum()) == 0
        else:
            assert sink is None
        if what == "workspace":
            assert third is out
        else:
            assert third.dtype == torch.uint8 and third.numel() == 100 + tokens  # the size its query answered


@pytest.mark.parametrize("refused, calls", [(("workspace", 1), 1), (("launch", 1), 2), (("workspace", 2), 3),
                                            (("launch", 2), 4)])
def test_a_refused_call_is_the_answer_naming_its_query_tokens_and_the_devices_message(refused, calls):
    device = Device(refuse=[refused])
    assert form_probe.refusal(device, SHAPE, BF16, None, False) == (
        f"the device's FIA refused a call of this layer's form at {refused[1]} query token(s): EZ9999: {refused[0]} "
        f"refused")
    assert len(device.calls) == calls  # nothing asked after the refusal


def test_the_device_is_asked_once_per_torch_npu_module_device_and_form():
    device = Device(refuse=[("launch", 2)])
    first = form_probe.refusal(device, SHAPE, BF16, 24, False)
    assert first is not None and len(device.calls) == 4
    assert form_probe.refusal(device, SHAPE, BF16, 48, False) == first  # another window, the same form
    assert len(device.calls) == 4
    for window, sinks, dtype, shape in [(None, False, BF16, SHAPE), (24, True, BF16, SHAPE),
                                        (24, False, torch.float16, SHAPE),
                                        (24, False, BF16, tiling.AttentionShape(4, 4, 16, 128)),
                                        (24, False, BF16, tiling.AttentionShape(8, 2, 16, 128)),
                                        (24, False, BF16, tiling.AttentionShape(4, 2, 32, 128)),
                                        (24, False, BF16, tiling.AttentionShape(4, 2, 16, 256))]:
        before = len(device.calls)
        form_probe.refusal(device, shape, dtype, window, sinks)
        assert len(device.calls) == before + 4, (window, sinks, dtype, shape)
    before = len(device.calls)
    device.device = torch.device("meta")  # another device of the same module
    assert form_probe.refusal(device, SHAPE, BF16, 24, False) == first and len(device.calls) == before + 4
    other = Device(refuse=[("launch", 2)])  # another module (each fake a test installs)
    assert form_probe.refusal(other, SHAPE, BF16, 24, False) == first and len(other.calls) == 4


def test_each_answer_is_logged_once_with_its_form(caplog):
    device = Device(refuse=[("launch", 1)])
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        form_probe.refusal(device, SHAPE, BF16, None, False)
        form_probe.refusal(device, SHAPE, BF16, 24, True)
        form_probe.refusal(Device(), SHAPE, torch.float16, None, False)
        form_probe.refusal(Device(), SHAPE, torch.float16, 8, True)
        form_probe.refusal(device, SHAPE, BF16, None, False)
    assert [r.getMessage() for r in caplog.records] == [
        "ascend_compile: the FIA form probe (heads 4, KV heads 2, head dim 16, torch.bfloat16, blocks of 128): "
        "refused: the device's FIA refused a call of this layer's form at 1 query token(s): EZ9999: launch refused",
        "ascend_compile: the FIA form probe (heads 4, KV heads 2, head dim 16, torch.bfloat16, blocks of 128, "
        "windowed, sinks): refused: the device's FIA refused a call of this layer's form at 1 query token(s): "
        "EZ9999: launch refused",
        "ascend_compile: the FIA form probe (heads 4, KV heads 2, head dim 16, torch.float16, blocks of 128): taken",
        "ascend_compile: the FIA form probe (heads 4, KV heads 2, head dim 16, torch.float16, blocks of 128, windowed, "
        "sinks): taken",
    ]


@pytest.mark.parametrize("source, dim, window, at", [
    (sources.OLDER, 64, None, None), (sources.OLDER, 96, None, 1), (sources.LATER, 96, None, None),
    (sources.LATER, 96, 24, 2), (sources.LATER, 64, 24, None)])
def test_on_the_fake_device_each_kernel_sources_answer_is_the_probes(monkeypatch, source, dim, window, at):
    # a head dim of 96 is taken by the later source's SplitFuse path, not in band mode (its PFA rule), nor by the older
    fake = fake_torch_npu.install(monkeypatch)
    fake.kernel_source = source
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), torch.device("cpu"))
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=dim, block_size=128)
    answer = form_probe.refusal(kernels, shape, BF16, window, False)
    if at is None:
        assert answer is None
    else:
        assert answer.startswith(f"the device's FIA refused a call of this layer's form at {at} query token(s): "
                                 f"EZ9999: fake aclnn: "), answer
