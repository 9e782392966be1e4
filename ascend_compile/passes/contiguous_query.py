"""Stage each kernel's query contiguous, for kernels that take only contiguous queries (torch_npu's).

torch_npu's FIA takes a contiguous query ("query ... 不支持非连续的Tensor", torch_npu 2.14
`_op_plugin_docs.py`, npu_fused_infer_attention_score), and ATB's PA takes contiguous tensors (its
plugin's error "at_tensor is not contiguous"). A model's query is often a view of a fused QKV
projection (vLLM's is), so where a kernel's query is not contiguous this pass copies it into a
contiguous tensor with a node of its own, before the kernel and outside its task group (so task
updates re-issue the kernel alone), and makes the kernel's `out` like the copy. The copy is the step's
query: a few KiB per layer, unlike a cache, which must be contiguous already (`passes/npu_checks.py`).
"""
from __future__ import annotations

from torch import fx

from .fx_utils import clone_graph_module, example_value
from .kernel_call import arg_names, kernel_calls

#: The query arguments of the kernels: PA's and FIA's query, MLA's absorbed query and its rope part
#: (FIA v2: query and query_rope "不支持非连续的Tensor", `_op_plugin_docs.py` L8589, L8597).
QUERY_ARGS = ("query", "q_nope", "q_pe")


def contiguous_queries(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose kernels read `query.contiguous()`: a copy where the step's query is not
    contiguous, the query itself where it is. Every kernel gets the node, whatever the traced
    strides say: a graph traced with every size symbolic may record a query's strides as contiguous
    while a step's query is a strided view (vLLM's, of the fused QKV projection)."""
    if not kernel_calls(gm):
        return gm
    gm = clone_graph_module(gm)
    graph = gm.graph
    for call in kernel_calls(gm):
        out = call.arg("out")
        for name in QUERY_ARGS:
            if name not in arg_names(call.op):
                continue
            query = call.arg(name)
            like_query = out.args[:1] == (query,)  # `empty_like(query)`, as select_kernels makes it
            with graph.inserting_before(out if like_query else call.node):
                staged = graph.call_method("contiguous", (query,))
            staged.meta["example_value"] = example_value(query).contiguous()
            call.node.update_arg(arg_names(call.op).index(name), staged)
            if like_query:
                out.update_arg(0, staged)
    graph.lint()
    gm.recompile()
    return gm
