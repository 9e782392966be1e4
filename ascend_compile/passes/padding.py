"""What the padding sequences of a step get in a kernel's host lists: the one rule the runner pads
by (`lowering/inputs.py`) and the NPU target checks a capture by (`npu_checks.py`).

Decode steps give each padded token a padding sequence of its own (one query token, KV length 1):
PA's layout, one query row per sequence, as vLLM-Ascend pads uniform decode batches. Mixed steps
pack their padded tokens into dummy sequences of at most `PADDING_CHUNK` tokens, each with its query
length as KV length, as vLLM-Ascend's full-graph mode adds one dummy request for them and gives FIA
the step's own batch size at each task update (`vllm_ascend/worker/model_runner_v1.py`,
`_pad_query_start_loc_for_fia`; `attention_v1.py` pads `seq_lens_list` and the block table to that
batch). So no padded token is left without a sequence, and FIA's cost stays linear in the padded
tokens (a dummy's rows attend at most 128 keys). On npu the binding then extends every FIA call's
lists with empty entries (0 query tokens, KV 0) up to the block table's rows (`ops/npu/kernels.py`:
`table_batch`), so that a captured task's batch never changes at update: those entries hold no
token and read no key (the kernel's TND check allows them). vLLM-Ascend gives its dummy KV length 1, which
leaves rows attending no key, whose output no document defines; a dummy here stays inside the
kernels' documented contract. A graph with MLA packs into dummies of at most 16 tokens, FIA v2's
limit. A graph serving mixed steps is captured with its padding packed (a mixed call, which FIA v2's
MLA form needs for its mixed sparse mode).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from torch import fx

from ..ops import tiling
from .kernel_call import kernel_calls
from .fx_utils import example_value, size_expr
from .size_symbols import evaluate
from .workspaces import GraphKey

#: The most query tokens a dummy sequence holds: FIA's smallest block size for query lengths above 1
#: (torch_npu 2.14 `_op_plugin_docs.py`, npu_fused_infer_attention_score's block_size), so a dummy's
#: keys fit one block.
PADDING_CHUNK = 128


#: What padding sequences get, as `plan.json` and `inspect` say it.
PADDING_SEQUENCES = (f"decode steps: one padding sequence per padded token (1 query token, KV length 1); mixed "
                     f"steps: the padded tokens in dummy sequences of at most {PADDING_CHUNK} tokens, each its "
                     f"query length as KV length, the kernels' batch being the step's sequences plus the dummies")


@functools.lru_cache(maxsize=4096)
def dummy_query_lens(pad: int, room: int, limit: int = PADDING_CHUNK) -> tuple[int, ...]:
    """The query lengths of the dummy sequences holding `pad` padded tokens in at most `room`
    sequences: `ceil(pad / limit)` of them (fewer where room is short), of balanced sizes."""
    count = min(-(-pad // limit), room)
    if count <= 0:
        return ()
    base, extra = divmod(pad, count)
    return tuple(base + (i < extra) for i in range(count))


#: The most query tokens per sequence of FIA v2's MLA form ("Q_S...1~16", torch_npu 2.14
#: `_op_plugin_docs.py` L8724): a graph with MLA packs its padding into dummies of at most this many.
MLA_PADDING_CHUNK = 16


def dummy_limit(gm: fx.GraphModule, padded: Mapping[Any, int] | None = None) -> int:
    """The most query tokens a dummy sequence of `gm`'s mixed steps holds: the kernels' limit and, given
    the padded sizes `padded` of a captured graph, what one row of its block tables holds (its width
    times the block size: a dummy's KV length is its query length, and its keys are in the blocks its
    row names; a `max_model_len` below the limit makes that row shorter)."""
    calls = kernel_calls(gm)
    limit = MLA_PADDING_CHUNK if any(call.meta.kernel == tiling.MLA for call in calls) else PADDING_CHUNK
    for call in calls if padded is not None else ():
        table = example_value(call.arg("block_table"))
        cache = example_value(call.arg("kv_c_cache" if call.meta.kernel == tiling.MLA else "key_cache"))
        limit = min(limit, evaluate(size_expr(table.shape[1]), padded) * int(cache.shape[1]))
    return limit


def packed_capture(gm: fx.GraphModule, key: GraphKey, mixed_graph_kernels: frozenset[str]) -> bool:
    """Whether `gm`, captured as `key`'s graph, is captured with its padding packed: a graph that
    serves mixed steps (a mixed graph, or a decode graph with none of the kernels that get a mixed graph
    of their own, `pipeline.bucket_choices`)."""
    return not key.decode or all(call.meta.kernel not in mixed_graph_kernels for call in kernel_calls(gm))


def capture_kv_lens(bucket: int, packed: bool, limit: int = PADDING_CHUNK) -> tuple[int, ...]:
    """The KV lengths a kernel of an all-padding capture of `bucket` tokens is given."""
    return dummy_query_lens(bucket, bucket, limit) if packed else (1,) * bucket
