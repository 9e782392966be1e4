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
