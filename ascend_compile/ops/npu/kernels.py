"""The attention kernels on Ascend: bindings to torch_npu 2.10.0.post4 and 2.14.0, and their workspace queries.

PA runs as `torch_npu._npu_paged_attention` (ATB) and FIA as
`torch_npu.npu_fused_infer_attention_score.out` (aclnn), each called with exactly the argument names
and order of the schemas in the torch_npu wheels, the same in both (`tests/fixtures/torch_npu_2_14_schemas.txt`,
`torch_npu_2_10_0_post4_schemas.txt`; what a torch_npu lacking one gets: `ops/npu/api.py`):

- PA: `(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
  context_lens, out, *, workspace=)`, `context_lens` a CPU int32 tensor (ATB reads it on the host);
  `workspace` is keyword-only.
- FIA: TND layout, K/V caches viewed as `[num_blocks, block_size, KVH*D]`, `block_table` and
  `block_size` (paged KV), `actual_seq_lengths` cumulative query ends (last == T),
  `actual_seq_lengths_kv` per-sequence lengths, `sparse_mode=3` (rightDownCausal: each sequence's
  query tokens are the last of its KV, causal among themselves) with the 2048x2048 mask that mode
  requires, `workspace=`, and `out=[attention_out, softmax_lse]` (the registered overload takes `out`
  as a list). A layer's window is FIA's band mode (sparse 4 with `pre_tokens`/`next_tokens`) and its
  sinks FIA v2's `learnable_sink`, as vLLM-Ascend binds them; a soft-cap is refused (`ops/npu/features.py`).

The KV-cache write runs as `torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm")`. MLA's kernel
and cache write are bound in `ops/npu/mla.py` (FIA v2's `query_rope` / `key_rope` form).

Ascend gives no formula for the workspace these kernels need, only queries
(`_npu_paged_attention_get_workspace` for given lengths, `_npu_fused_infer_attention_score_get_max_workspace`
for any): `NpuKernels.workspace_nbytes` asks either, `ops/npu/workspace_queries.py` asks them at compile time
on probe tensors, and nothing is queried or allocated at replay. The kernels' documented constraints
are in `ops/npu/rules.py`.

torch_npu is imported lazily, by `load_torch_npu`: importing this module needs no NPU.
"""
from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Sequence

import torch

from .. import library, tiling, validate
from . import band_probe as npu_band_probe, features as npu_features, mla as npu_mla
from .rules import check_fia_block_size
from ..timing import median_seconds
from ..tiling import AttentionShape

log = logging.getLogger("ascend_compile")

#: The side of the optimised causal mask FIA's sparse modes 2-4 take.
FIA_MASK_SIZE = 2048


def load_torch_npu() -> ModuleType:
    """Import torch_npu (which also installs `torch.npu`), with an error saying what is missing."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise ImportError(
            "runtime: 'npu' needs torch_npu (pip install torch-npu matching your torch and CANN; "
            "see docs/ascend.md)"
        ) from err


def fia_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 mask of FIA sparse_mode 3: True above the diagonal (masked out)."""
    return torch.triu(torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


def paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    scale: float,
    out: torch.Tensor,
) -> tuple[Any, ...]:
    """The positional arguments of `_npu_paged_attention` and of its workspace query."""
    lens = torch.tensor(list(context_lens), dtype=torch.int32)
    return (
        query, key_cache, value_cache, int(key_cache.shape[2]), int(query.shape[1]), float(scale),
        block_table, lens, out,
    )


def fused_infer_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_lengths: Sequence[int],
    actual_seq_lengths_kv: Sequence[int],
    scale: float,
    atten_mask: torch.Tensor,
    pre_tokens: int | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of `npu_fused_infer_attention_score` (TND, paged KV), in
    schema order, shared by the `.out` call and the workspace query; with a window, band mode of
    `pre_tokens` (`npu_features.sparse_mode`, `band_tokens`; the device's edge probe finds it for a window:
    `NpuKernels.pre_tokens`)."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    check_fia_block_size(int(block_size))
    key = key_cache.view(num_blocks, block_size, kv_heads * head_dim)
    value = value_cache.view(num_blocks, block_size, kv_heads * head_dim)
    kwargs = {
        "atten_mask": atten_mask,
        "actual_seq_lengths": [int(n) for n in actual_seq_lengths],
        "actual_seq_lengths_kv": [int(n) for n in actual_seq_lengths_kv],
        "block_table": block_table,
        "num_heads": int(query.shape[1]),
        "scale": float(scale),
        **npu_features.band_tokens(pre_tokens),
        "input_layout": "TND",
        "num_key_value_heads": int(kv_heads),
        "sparse_mode": npu_features.sparse_mode(pre_tokens),
        "block_size": int(block_size),
    }
    return (query, key, value), kwargs


def table_batch(block_table: torch.Tensor, ends: Sequence[int], kv_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """FIA's lists for a call on `block_table`, padded to a batch of its rows with empty sequences (0 query
    tokens, KV 0: the last end repeated), so that a graph's every call, captured or updated, has the batch and
    the block table tensor it was captured with.

    FIA's batch is its lists' length, and its block table has exactly that many rows ("第一维长度需等于B",
    L8223; kernel source c29bc106 `prompt_flash_attention_tiling.cpp` L2262-2266 refuses another row count, and
    TND takes no tiling sink, L4269-4271). A mixed graph's steps have fewer sequences than its table's rows, and
    narrowing the table per step would rebind a tensor of another shape at each update, which vLLM-Ascend found
    to corrupt sliding-window models' outputs ("Keep the captured block_tables tensor", `attention_v1.py`
    L866-875), and would grow the batch past the capture's where the capture had fewer sequences than a step.
    An empty sequence is what the kernel's TND check allows (`CheckActSeqWhenLayoutIsTND`, L3822-3863: query
    ends non-decreasing, lengths >= 0); it adds no query row and no block ("blocknum..." counts its KV 0 as none)."""
    validate.sequence_rows(block_table, len(kv_lens))  # a row per sequence at least
    ends, kv_lens = [int(n) for n in ends], [int(n) for n in kv_lens]
    pad = int(block_table.shape[0]) - len(kv_lens)  # lists of unequal lengths stay unequal: refused after
    return ends + [ends[-1] if ends else 0] * pad, kv_lens + [0] * pad


def _nbytes(workspace: torch.Tensor) -> int:
    """The bytes a workspace query's answer spans."""
    return int(workspace.numel()) * workspace.element_size()


class NpuKernels:
    """The `ascend` kernel ops bound to torch_npu on one device: what `NpuRuntime.kernel` returns.

    The calls match the ops' signatures, so capture and task updates issue them in place of the ops.
    The constant tensors they pass (FIA's causal mask, and the `[1]` softmax_lse FIA writes when
    `softmax_lse_flag` is False) are made once, here, outside any capture: a tensor first made inside
    a capture would be uninitialised for every other graph, and one made during a task update would be
    freed while the updated task still points at it.

    PA's `context_lens` is a CPU tensor made per call, which ATB reads on the host when the launch is
    processed; with the task queue on (`TASK_QUEUE_ENABLE`) that is after the call returns. Each is
    kept in `host_tensors` until its owner takes it (`take_host_tensors`): the graph it was captured
    into, or the runtime once the device has synchronized. vLLM-Ascend keeps its `seq_lens` alive the
    same way (the step's attention metadata holds them), and torch_npu's own graph records copy CPU
    arguments (`torch_npu/npu/_npugraph_handlers/npugraph_handler.py`, `record_wrap_kwarg`).
    """

    def __init__(self, torch_npu: ModuleType, device: torch.device) -> None:
        self.torch_npu = torch_npu
        self.device = torch.device(device)
        self.atten_mask = fia_causal_mask(self.device)
        self.softmax_lse = torch.empty(1, dtype=torch.float32, device=self.device)
        self.host_tensors: list[torch.Tensor] = []

    def take_host_tensors(self) -> list[torch.Tensor]:
        """The host tensors passed to kernels since the last take; the caller keeps them alive."""
        taken, self.host_tensors = self.host_tensors, []
        return taken

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: list[int],
        scale: float,
        workspace: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`ascend.paged_attention` as `torch_npu._npu_paged_attention` with a caller workspace."""
        library.check_paged_attention(
            query, key_cache, value_cache, block_table, context_lens, workspace, out, check_data=False
        )
        args = paged_attention_args(query, key_cache, value_cache, block_table, context_lens, scale, out)
        self.host_tensors.append(args[7])
        self.torch_npu._npu_paged_attention(*args, workspace=workspace)

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        scale: float,
        workspace: torch.Tensor,
        out: torch.Tensor,
        window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """`ascend.fused_infer_attention` as `torch_npu.npu_fused_infer_attention_score.out`, a window as
        its band mode; with sinks as `npu_fused_infer_attention_score_v2.out` (`learnable_sink`). A soft-cap
        is refused here as at compile time (`ops/npu/features.py`: torch_npu's FIA has none), and so is a
        windowed call of one query token per sequence with one longer than the window where the device does
        not apply the band at S 1 (`ops/npu/band_probe.py`; the step guard sends such steps eagerly first),
        and every windowed call where the device's edge probe found no `pre_tokens` serving the window (its
        graphs run eagerly first: `NpuTarget.eager_reason`)."""
        library.check_features(query, window, soft_cap, sinks)
        if soft_cap is not None:
            raise ValueError(f"soft_cap: not supported on runtime 'npu': {npu_features.SOFT_CAP_REFUSAL}")
        ends, kv_lens = table_batch(block_table, actual_seq_lengths, actual_seq_lengths_kv)
        library.check_fused_infer_attention(query, key_cache, value_cache, block_table, ends, kv_lens, workspace, out,
                                            check_data=False)
        form = npu_band_probe.form_of_call(query, key_cache, sinks is not None)
        pre_tokens = self.pre_tokens(window, form)
        if window is not None and pre_tokens is None:
            raise ValueError(f"window: a window of {window} is not served on FIA: {npu_band_probe.EDGE_REFUSAL}")
        if npu_band_probe.single_query_outside(actual_seq_lengths, actual_seq_lengths_kv, window) and \
                not self.band_at_single_query(form):
            raise ValueError(f"window: a call of one query token per sequence with one longer than the window of "
                             f"{window} would attend the whole context: {npu_band_probe.REFUSAL}")
        if window is not None and npu_band_probe.single_query(actual_seq_lengths) and not self.band_at_single_query(form):
            pre_tokens = None  # no band where the device's S=1 band is not the window: every key, within the window
        self.launch_fia(query, key_cache, value_cache, block_table, ends, kv_lens, scale, workspace, out, pre_tokens,
                        sinks)

    def pre_tokens(self, window: int | None, form: npu_band_probe.BandForm) -> int | None:
        """FIA's `pre_tokens` for a layer of `window` and `form`: `W - 1` or `W`, as this device's edge probe
        found (asked once per process and form: `ops/npu/band_probe.py`); None without a window, or where the
        probe found neither."""
        return npu_band_probe.pre_tokens(self, window, form)

    def band_at_single_query(self, form: npu_band_probe.BandForm) -> bool:
        """Whether this device applies FIA's band when every sequence has one query token (its probe's
        answer for a layer of `form`, asked once per process and form: `ops/npu/band_probe.py`)."""
        return npu_band_probe.band_at_single_query(self, form)

    def launch_fia(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, actual_seq_lengths: Sequence[int], actual_seq_lengths_kv: Sequence[int],
                   scale: float, workspace: torch.Tensor, out: torch.Tensor, pre_tokens: int | None,
                   sinks: torch.Tensor | None) -> None:
        """FIA v1, or v2 with sinks, called on checked arguments, band mode of `pre_tokens` where not None
        (the band probes call it directly)."""
        if sinks is not None:
            npu_features.sinks_attention(self.torch_npu, self.atten_mask, self.softmax_lse, query, key_cache,
                                         value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv, scale,
                                         pre_tokens, sinks, workspace, out)
            return
        args, kwargs = fused_infer_attention_args(
            query, key_cache, value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv, scale,
            self.atten_mask, pre_tokens,
        )
        self.torch_npu.npu_fused_infer_attention_score.out(
            *args, **kwargs, workspace=workspace, out=[out, self.softmax_lse]
        )

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """`ascend.reshape_and_cache` as `torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm")`, the
        write vLLM-Ascend issues on A2/A3 (`vllm_ascend/device/device_op.py`, `BaseDeviceAdaptor`), with
        key, value and slots made contiguous as it does ("输入参数不支持非连续", torch_npu 2.14
        `_op_plugin_docs.py`; a copy of this step's tokens, never of a cache: non-contiguous caches are
        refused at compile time, `ops/npu/rules.py`). "Norm" selects the ND cache layout
        `[num_blocks, block_size, KVH, D]` (the default, "PA_NZ", takes NZ-format caches).

        It reads no device data on the host, unlike the reference body (which checks the slots' range
        on the host): the ACL graph records the kernel once and replays it with each step's slots.

        Padding tokens keep slot -1. The docs allow slots in `[0, num_blocks*block_size-1]` only, and
        distinct ("slot_mapping的值范围[0,num_blocks*block_size-1]，且slot_mapping内的元素值保证不重复"), so no
        documented value serves a padding token: -1 is outside the range, and one reserved slot for every
        padding token would repeat, and reserving one per token would take cache blocks the caller owns.
        -1 is what the kernel skips in its source (ops-transformer `scatter_pa_kv_cache_nd.h`:
        `if (slotValue < 0) continue;`) and what vLLM-Ascend sends in full-graph mode
        (`vllm_ascend/worker/model_runner_v1.py`: "Fill unused with -1. Needed for reshape_and_cache in
        full cuda graph mode"): proven practice, not a documented contract (docs/ascend.md lists it as
        unverified)."""
        library.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        self.torch_npu.npu_scatter_pa_kv_cache(
            key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping.contiguous(), cache_mode="Norm"
        )

    def mla_fused_infer_attention(self, *args: Any) -> None:
        """`ascend.mla_fused_infer_attention` (its arguments) as FIA v2's MLA form (`npu_mla.mla_attention`)."""
        npu_mla.mla_attention(self.torch_npu, self.atten_mask, self.softmax_lse, *args)

    def mla_cache_write(self, *args: Any) -> None:
        """`ascend.mla_cache_write` (its arguments) as `npu_scatter_pa_kv_cache` (`npu_mla.mla_cache_write`)."""
        npu_mla.mla_cache_write(self.torch_npu, *args)

    def mla_workspace_nbytes(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                             k_pe_cache: torch.Tensor, block_table: torch.Tensor, query_ends: Sequence[int],
                             kv_lens: Sequence[int], scale: float) -> int:
        """Bytes the MLA kernel needs at most for these shapes, from FIA v2's max-workspace query."""
        return _nbytes(npu_mla.mla_workspace(self.torch_npu, self.atten_mask, q_nope, q_pe, kv_c_cache, k_pe_cache,
                                             block_table, query_ends, kv_lens, scale))

    def workspace_nbytes(
        self,
        kernel: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_ends: Sequence[int],
        kv_lens: Sequence[int],
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> int:
        """Bytes `kernel` needs for these host lengths, from torch_npu's workspace query; FIA's asked in
        the form its calls take for a layer of `window` and `sinks` (v2's query with sinks).

        Both queries return the workspace itself, a 1-D tensor whose dtype is the op's choice (torch_npu
        passes FIA's answer straight back as `workspace=`: `_npugraph_handlers/ifa_handler.py`), so its
        size is `numel * element_size` bytes, not its element count. A window whose `pre_tokens` the edge
        probe found none for is asked as the docs' band (`W - 1`): its calls are refused, the answer sizes
        nothing that runs."""
        if kernel == tiling.PA:
            args = paged_attention_args(query, key_cache, value_cache, block_table, kv_lens, scale, out)
            return _nbytes(self.torch_npu._npu_paged_attention_get_workspace(*args))
        if kernel == tiling.FIA:
            pre = self.pre_tokens(window, npu_band_probe.form_of_call(query, key_cache, sinks is not None))
            pre = int(window) - 1 if window is not None and pre is None else pre
            return self.band_workspace_nbytes(query, key_cache, value_cache, block_table, query_ends, kv_lens, scale,
                                              out, pre, sinks)
        raise ValueError(f"kernel: expected {tiling.PA!r} or {tiling.FIA!r}, got {kernel!r}")

    def band_workspace_nbytes(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_table: torch.Tensor, query_ends: Sequence[int], kv_lens: Sequence[int],
                              scale: float, out: torch.Tensor, pre_tokens: int | None,
                              sinks: torch.Tensor | None) -> int:
        """FIA's workspace query (v2's with sinks) in band mode of `pre_tokens` where not None."""
        if sinks is not None:
            return _nbytes(npu_features.sinks_workspace(self.torch_npu, self.atten_mask, query, key_cache, value_cache,
                                                        block_table, query_ends, kv_lens, scale, pre_tokens, sinks))
        args, kwargs = fused_infer_attention_args(
            query, key_cache, value_cache, block_table, query_ends, kv_lens, scale, self.atten_mask, pre_tokens
        )
        return _nbytes(self.torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs))

    def call(self, kernel: str, *args: Any) -> None:
        """Run `kernel` ("paged_attention" or "fused_infer_attention") with the ascend op's arguments."""
        if kernel == tiling.PA:
            self.paged_attention(*args)
        elif kernel == tiling.FIA:
            self.fused_infer_attention(*args)
        else:
            raise ValueError(f"kernel: expected {tiling.PA!r} or {tiling.FIA!r}, got {kernel!r}")


def time_kernel(
    kernels: NpuKernels,
    synchronize: Callable[[], None],
    kernel: str,
    shape: AttentionShape,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    repeats: int = 3,
) -> float:
    """Median seconds of one decode call of the torch_npu `kernel` for `batch` sequences of
    `seq_len` tokens, for the "auto" kernel policy (`synchronize` waits for the device); infinite where the
    device refuses the call (a layer form its kernel does not take: the other kernel is chosen, and a graph
    that needs this one is refused by the form probe, naming the layer)."""
    device = kernels.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-seq_len // shape.block_size)
    cache_shape = (batch * blocks_per_seq, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    block_table = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty_like(query)
    lens, ends = [seq_len] * batch, list(range(1, batch + 1))
    scale = shape.head_dim**-0.5
    host = (lens,) if kernel == tiling.PA else (ends, lens)
    try:
        nbytes = kernels.workspace_nbytes(kernel, query, key_cache, value_cache, block_table, ends, lens, scale, out)
        args = (query, key_cache, value_cache, block_table, *host, scale,
                torch.empty(nbytes, dtype=torch.uint8, device=device), out)
        return median_seconds(lambda: kernels.call(kernel, *args), synchronize, warmup=1, iters=repeats)
    except RuntimeError as err:  # the device's kernel refuses this form (`ops/npu/form_probe.py`): no candidate
        log.info("ascend_compile: %s refused a timing call of %s in %s (timed as never finishing): %s", kernel, shape,
                 dtype, err)
        return float("inf")
