"""The FIA kernel's own TND rules in two versions of its source, which the fake torch_npu plays on request
(`FakeNpu.kernel_source`; None, the default, plays the docs' rules only, as the tests of other issues expect).

Every FIA call of the project is TND, paged, without rope and of a head dim other than 512. Read in
hicann/ops-transformer:

- `c29bc106`: such a call always takes the PFA tiling (`fused_infer_attention_score_tiling.cpp` L700-716),
  whose TND rules are a bfloat16 input (`prompt_flash_attention_tiling.cpp` L3813-3816), a head dim of 64 or 128,
  or 192 where every query head has its own KV head (L3800-3803, L3805-3807), 64 or 128 with `learnable_sink`
  (L3669-3671) and in band mode, sparse 4 (L4919-4921);
- a later source (the mirror repo-mirror-test/ops-transformer at `bfbbec83`, 2025-12; the audit's 125d5d3a
  was not reachable here): a SplitFuse path for TND calls without sinks or rope, of sparse mode 0 or 3,
  several query heads per KV head, `inner_precise` 0, paged in blocks of 128 and D <= 256
  (`fused_infer_attention_score_tiling.cpp` L1181-1229, `IsUsingFAI`), taking float16 and bfloat16 (L975-977);
  every other call the PFA tiling as before (`prompt_flash_attention_tiling.cpp` L3693-3695, L3680-3687, L3556,
  L4784).

Each refusal is the device's (`fake_torch_npu.device_refusal`: a RuntimeError, as torch_npu raises an aclnn
error), so what the compile-time form probe (`ops/npu/form_probe.py`) reads.
"""
from __future__ import annotations

import torch

from tests import fake_torch_npu as base

OLDER, LATER = "c29bc106", "bfbbec83"
SOURCES = (OLDER, LATER)
#: Where each PFA rule is, per source: (dtype, head dim, head dim with G != 1, sinks, band).
PFA_LINES = {OLDER: ("L3813-3816", "L3800-3803", "L3805-3807", "L3669-3671", "L4919-4921"),
             LATER: ("L3693-3695", "L3680-3683", "L3685-3687", "L3556-3558", "L4784-4786")}


def split_fuse(source: str, heads: int, kv_heads: int, dim: int, block_size: int, sparse_mode: int, sinks: bool,
               inner_precise: int) -> bool:
    """Whether a TND paged call takes the later source's SplitFuse path (`IsUsingFAI`, L1181-1229)."""
    return source == LATER and not sinks and sparse_mode in (0, 3) and heads != kv_heads and inner_precise == 0 \
        and block_size == 128 and dim <= 256


def check(source: str | None, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int,
          sparse_mode: int, sinks: bool, inner_precise: int = 0) -> None:
    """Refuse, as the device of `source` does, a TND paged FIA call of this form (nothing when `source` is None)."""
    if source is None:
        return
    if source not in SOURCES:
        raise ValueError(f"kernel_source: the fake plays {SOURCES} or None, not {source!r}")
    if split_fuse(source, heads, kv_heads, dim, block_size, sparse_mode, sinks, inner_precise):
        if dtype not in (torch.float16, torch.bfloat16):
            base.device_refusal("query", "FP16 or BF16 (fused_infer_attention_score_tiling.cpp L975-977)", dtype)
        return
    dtype_line, dim_line, group_line, sinks_line, band_line = PFA_LINES[source]
    where = f"prompt_flash_attention_tiling.cpp at {source}"
    if dtype != torch.bfloat16:
        base.device_refusal("query", f"bf16 when layout is TND ({where} {dtype_line})", dtype)
    if dim not in (64, 128, 192):
        base.device_refusal("query", f"queryD, keyD and valueD equal 192/128/64 in TND ({where} {dim_line})", dim)
    if dim == 192 and heads != kv_heads:
        base.device_refusal("query", f"valueD not 192 when G is not 1 ({where} {group_line})", dim)
    if sinks and dim not in (64, 128):
        base.device_refusal("learnable_sink", f"valueD 64/128 with learnable_sink in TND ({where} {sinks_line})", dim)
    if sparse_mode == 4 and dim not in (64, 128):
        base.device_refusal("sparse_mode", f"valueD 64/128 with sparseMode 4 in TND ({where} {band_line})", dim)


#: The fake device's cube cores and library workspace, for the later source's MLA workspace (a device reads its own
#: platform info: `GetCoreNumAic`, `GetLibApiWorkSpaceSize`).
FAKE_CUBE_CORES, FAKE_LIBAPI_BYTES = 24, 16 << 20


def mla_max_workspace(source: str | None) -> int | None:
    """The MLA form's max workspace on the later source (hicann/ops-transformer 359e786a
    `attention/fused_infer_attention_score/op_host/arch22/fia_tiling_nonquant_mla.cpp`, `CalcMaxWorkspaceSize`:
    the library's workspace, then per cube core two preloads of the matmul and vector results at base sizes
    512 x 256 and 512 x 256 (`CalcMaxMmResSize`, `mBaseSize_` 256 in the header) and the flash-decode
    reductions): sized by the core count alone, no length nor token count. None where the fake plays another
    source (its answer is then the reference tiling's maximum)."""
    if source != LATER:
        return None
    m_base, head_dim_align, s2_max, preload = 256, 512, 512, 2
    mm1, mm2 = s2_max * m_base, head_dim_align * m_base
    normal = preload * FAKE_CUBE_CORES * (mm1 * (4 + 2) + mm2 * (4 + 4) + m_base * (4 + 4))
    fd_params = FAKE_CUBE_CORES * 2 * m_base
    flash_decode = (fd_params * head_dim_align + 2 * fd_params * 8) * 4
    return FAKE_LIBAPI_BYTES + normal + flash_decode


# ----------------------------------------------------------------------------- FIA's workspace, per form
#: The fake's FIA workspace answers (`FakeNpu.fia_workspace`, `install(..., fia_workspace=)`): None, the default, the
#: reference tiling's maximum for every form alike (`ascend_compile/ops/tiling.py`); OLDER, the sum the older source's
#: TND template asks (`fia_workspace_nbytes`); PER_FORM, that sum with a band's and sinks' own share on top, a device
#: whose answer also differs between FIA v1, its band and v2 with sinks (no source read here sizes them apart: see
#: `fia_workspace_nbytes`), so that a plan sized by another form's answer is seen.
PER_FORM = "per-form"
FIA_WORKSPACES = (None, OLDER, PER_FORM)
#: PER_FORM's share of a band (sparse 4) and of `learnable_sink` (FIA v2), per cube core: made-up sizes, only different.
PER_FORM_BAND_BYTES, PER_FORM_SINKS_BYTES = 64 << 10, 192 << 10


def fia_workspace_nbytes(mode: str, query: torch.Tensor, kv_heads: int, sequences: int, kv_capacity: int, band: bool,
                         sinks: bool) -> int:
    """FIA's workspace for a TND paged call of `query` `[T, H, D]` in `sequences` sequences, block-table rows of
    `kv_capacity` keys, band mode or not, sinks or not, as the fake's `mode` sizes it (`FIA_WORKSPACES`, not None).

    OLDER follows hicann/ops-transformer c29bc106 `attention/prompt_flash_attention/op_host/
    prompt_flash_attention_tiling.cpp`, the PFA tiling every TND call of this project takes there: its TND template's
    workspace (L5068-5073) is, per cube core, three copies of the first matmul's result of `nRatio` basic blocks and
    four of the second's, plus a fixed 16 MiB reserve (`WORK_SPACE_RESERVE_SIZE`, L171). The basic blocks are fixed by
    the value head dim (`MatchTemplate`, L3632-3646: 512 query rows and a ratio of 4 up to D 128, else 256 and 8;
    128 keys), cut to the aligned query and key sizes (L4923-4926, L5000-5008; under the max-workspace query the key
    size is the block table's width in keys, L2253-2254); the first result holds a whole head group, G query heads
    per KV head, where every sequence has one query token and G is at most 16 without rope or LSE (L5027-5043), and
    one head otherwise (`SetTensorSizeParams`, L3101-3107). So the one-query-token form (here: as many sequences as
    query tokens, none empty) asks up to G times the matmul share of another call of the same tokens. Neither the
    band (the sparse type and its tokens go into the tiling data only, L4956-4996) nor `learnable_sink` (L4956) enters
    that sum: under OLDER, FIA v1, its band and v2 with sinks answer alike. The score is float32 here (4 bytes).
    The max-workspace query is answered with this sum at the question's own form, read from the lists' sizes (the
    max path keeps only those: `FakeArray`, `aclnn_fused_infer_attention_score_inner.cpp` L106-120); whether a device
    tells the form apart there is not shown by the source (its PFA tiling refuses data-less TND lengths,
    L4269-4271): the fake plays the device that does, the one a plan asking a single form would under-size.
    """
    tokens, heads, dim = (int(n) for n in query.shape)
    group = heads // kv_heads
    small = dim <= 128
    s1_best, ratio = (512, 4) if small else (256, 8)
    align = lambda n: -(-n // 16) * 16  # noqa: E731
    s1, s2 = min(s1_best, align(tokens)), min(128, align(kv_capacity))
    ratio = min(ratio, -(-align(kv_capacity) // s2))
    g_base = group if sequences == tokens and group <= 16 else 1
    per_core = ratio * g_base * s1 * s2 * 4 * 3 + 4 * s1 * align(dim) * 4
    if mode == PER_FORM:
        per_core += PER_FORM_BAND_BYTES * band + PER_FORM_SINKS_BYTES * sinks
    elif mode != OLDER:
        raise ValueError(f"fia_workspace: the fake sizes {FIA_WORKSPACES}, not {mode!r}")
    return per_core * FAKE_CUBE_CORES + (16 << 20)


def fia_workspace_refusal(mode: str | None, query: torch.Tensor, kv_heads: int, sequences: int, kv_capacity: int,
                          band: bool, sinks: bool, workspace: torch.Tensor) -> None:
    """Refuse a FIA call given less workspace than `mode` sizes its form (nothing for None: the library's check of
    the reference tiling's need is the fake's then)."""
    if mode is None:
        return
    need = fia_workspace_nbytes(mode, query, kv_heads, sequences, kv_capacity, band, sinks)
    if workspace.numel() * workspace.element_size() < need:
        raise ValueError(f"workspace: expected at least {need} bytes for this call's form ({sequences} sequences of "
                         f"{query.shape[0]} query tokens{', band' if band else ''}{', sinks' if sinks else ''}; "
                         f"fia_workspace={mode!r}), got {workspace.numel() * workspace.element_size()}")


#: Where the older source compiles FIA's half-precision kernels: for a float16 query with float16 keys (L125) and a
#: bfloat16 query with bfloat16 keys (L337) only, in c29bc106 `attention/fused_infer_attention_score/op_kernel/
#: fused_infer_attention_score_template_tilingkey.h`; the other pairs it lists quantise the keys (int8, int4). A
#: query of one half dtype with caches of the other has no kernel to run: the call fails on the device.
MIXED_HALVES = ("a key and value of the query's dtype: FIA's half-precision kernels are built for float16/float16 and "
                "bfloat16/bfloat16 query/key pairs only (c29bc106 fused_infer_attention_score_template_tilingkey.h "
                "L125, L337)")


def check_one_half_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Refuse, as the device does (a RuntimeError), a query and caches of different half dtypes."""
    if key.dtype != query.dtype or value.dtype != query.dtype:
        base.device_refusal("key", MIXED_HALVES, f"a {query.dtype} query with {key.dtype} key and {value.dtype} value")
