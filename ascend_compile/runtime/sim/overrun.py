"""Workspace overruns on the ACL-graph simulator.

A kernel given less workspace than it needs does not fail on the device: it writes past its buffer
into whatever follows it in its segment (another workspace, an output, a KV block), which is the
bug class the simulator exists to reproduce. A model, kept because nothing on the device bounds a
kernel's writes to the buffer it was given (it writes where its tiling says, from the pointer it was
passed), and vLLM-Ascend met the consequence on hardware: a PA workspace sized at capture for one
length was short for others ("smaller seq_lens might encounter a bigger workspace", DESIGN.md §7
case 1), which it answers by re-querying `_npu_paged_attention_get_workspace` at every update
(`vllm_ascend/attention/utils.py`). The reference kernels raise `WorkspaceTooSmall`
instead; `widen_workspace` turns that into the write the device would do, by handing the kernel a
view of the same address as wide as it needs. Its own module because it is the one place that
reasons about a kernel's arguments against the memory layout.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ...errors import AscendCompileError, WorkspaceTooSmall
from .pool import Segment

logger = logging.getLogger("ascend_compile.sim")


def widen_workspace(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    err: WorkspaceTooSmall,
    label: str,
    locate: Callable[[torch.Tensor], Optional[tuple[Segment, int]]],
    error: type[AscendCompileError],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The operands with the workspace widened to `err.needed` bytes in place, as the kernel
    would write them on the device: into whatever follows the buffer in its segment. `error`
    (`CaptureError` or `ReplayError`) is raised when that cannot be simulated."""
    name = err.arg_name
    names = [a.name for a in op._schema.arguments]
    index = names.index(name) if name in names else len(names)
    if name in kwargs:
        buf = kwargs[name]
    elif index < len(args):
        buf = args[index]
    else:
        raise error(f"{label}: {err}; {op} was not passed an argument {name!r} to overrun") from err
    where = locate(buf)
    if where is None:
        raise error(
            f"{label}: {err}; the buffer is not simulator memory, so its overrun cannot be simulated"
        ) from err
    segment, offset = where
    count = -(-err.needed // buf.dtype.itemsize)
    if offset + count * buf.dtype.itemsize > segment.size:
        raise error(
            f"{label}: {err}; writing {err.needed} bytes from offset {offset} of {segment.pool.name} "
            f"segment {segment.index} runs past its end ({segment.size} bytes): the device would fault"
        ) from err
    logger.debug(
        "%s: workspace overrun: %s writes %d bytes into a %d-byte buffer", label, op, err.needed, err.given
    )
    wide = segment.view(offset, buf.dtype, (count,), (1,))
    if name in kwargs:
        return args, {**kwargs, name: wide}
    return (*args[:index], wide, *args[index + 1 :]), kwargs
