"""vLLM's own EAGLE drafter beside its Llama target (0.23.0 or 0.33.0), on the CPU of `tests/vllm_real.py`.

What vLLM builds with `speculative_config={"method": "eagle", "model": ..., "num_speculative_tokens": k}`,
by its own code: `SpeculativeConfig` (the draft `config.json` wrapped in vLLM's `EAGLEConfig`, the
architecture `EagleLlamaForCausalLM`), the target `LlamaForCausalLM` and the drafter
`vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM` (0.23 and 0.33: the same class name and
`forward(input_ids, positions, hidden_states)`; its one decoder layer's attention named after the
target's, `model.layers.2.self_attn.attn`) under one `VllmConfig`, each layer with its own KV cache
(`vllm_real.bind_caches`), the drafter's embedding and LM head the target's (what the proposer's
`load_model` does for a checkpoint without them: `_maybe_share_embeddings`, `_maybe_share_lm_head`).

The loop is vLLM's padded-batch EAGLE (`GPUModelRunner.propose_draft_token_ids`, `EagleProposer.propose`
in `vllm/v1/spec_decode/llm_base_proposer.py`), written out here (its Triton kernels do not run on a CPU):
a target step of 1 + d tokens per request (d its drafts this step, 0 for a plain decode), greedy
acceptance (a draft is accepted while it equals the target's argmax before it; then one bonus token);
the drafter's first pass over the target's tokens shifted by one with each request's next token at its
last accepted row (`token_indices_to_sample`), the target's hidden states and metadata; then per further
draft one-token steps at the next position, `seq_lens` less the rejected tokens, plus one each step.

The weights are seeded random, shaped so that drafts are sometimes accepted, sometimes not: each
layer's output projections scaled down, so the target's next token follows mostly from its current
one (the shared embedding and LM head), and the drafter's `fc` taken mostly from the token's embedding.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from tests import vllm_real as real

from vllm.config import SpeculativeConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.utils import get_model_architecture, process_weights_after_loading  # noqa: E402

#: `num_speculative_tokens`; the drafter's `config.json` (one decoder layer, vLLM's EAGLE head for Llama).
K = 3
DRAFT_LLAMA = {**real.TINY_LLAMA, "num_hidden_layers": 1}
#: The weights' shaping (module docstring): the target's and the drafter's output projections scaled by
#: SCALE and DRAFT_SCALE, the drafter's `fc` the identity on the embedding plus FC_NOISE times its random
#: weights. `tests/test_vllm_eagle.py`'s 24 steps accept 65 of 151 drafts; the drafter's attention changes
#: its drafts (a 20-step tuning run: 57 of 127 accepted, 109 with DRAFT_SCALE 0).
SCALE, DRAFT_SCALE, FC_NOISE = 0.1, 0.3, 0.05
#: The drafter's one attention layer, named after the target's layers (`start_layer_id`).
DRAFTER_LAYER = real.LAYER.format(real.TINY_LLAMA["num_hidden_layers"])


def vllm_config(where: Path, compile_mode: int = 0, k: int = K, **config: Any) -> VllmConfig:
    """`vllm_real.vllm_config`'s config with vLLM's `SpeculativeConfig` for an EAGLE head of `k` drafts
    (its `config.json` written to `where/draft`)."""
    (where / "target").mkdir(exist_ok=True)
    (where / "draft").mkdir(exist_ok=True)
    (where / "draft" / "config.json").write_text(json.dumps(DRAFT_LLAMA))
    base = real.vllm_config(where / "target", compile_mode, **config)
    spec = SpeculativeConfig(method="eagle", model=str(where / "draft"), num_speculative_tokens=k,
                             target_model_config=base.model_config, target_parallel_config=base.parallel_config)
    return VllmConfig(model_config=base.model_config, cache_config=base.cache_config,
                      scheduler_config=base.scheduler_config, compilation_config=base.compilation_config,
                      speculative_config=spec)


@dataclasses.dataclass
class Part(real.Model):
    """One of the two models, with the names of its own attention layers."""

    names: tuple[str, ...] = ()

    @property
    def layers(self) -> dict[str, Any]:
        return {name: layer for name, layer in real.attention_layers(self.config).items() if name in self.names}


@dataclasses.dataclass
class Pair:
    """A target and its drafter under one `VllmConfig`."""

    target: Part
    drafter: Part


def _scale_outputs(model: torch.nn.Module, factor: float) -> None:
    """Scale each decoder layer's output projections (attention's `o_proj`, the MLP's `down_proj`)."""
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            param.data.mul_(factor)


def build(config: VllmConfig, seed: int = 0, num_blocks: int = 128) -> Pair:
    """The target (`vllm_real.build`) and vLLM's EAGLE drafter for it, seeded, the drafter sharing the
    target's embedding and LM head; every attention layer's KV cache bound again, the drafter's with them."""
    target = real.build(config, seed, num_blocks)
    target_names = tuple(target.layers)
    _scale_outputs(target.model, SCALE)
    with torch.no_grad():
        target.model.model.norm.weight.fill_(1.0)
    spec = config.speculative_config
    with set_current_vllm_config(config):
        torch.manual_seed(seed + 1)
        drafter_cls, _ = get_model_architecture(spec.draft_model_config)
        drafter = drafter_cls(vllm_config=config, prefix="")
        for param in drafter.parameters():
            torch.nn.init.normal_(param, std=0.2)
        _scale_outputs(drafter, DRAFT_SCALE)
        hidden = DRAFT_LLAMA["hidden_size"]
        with torch.no_grad():  # fc([embedding, hidden]): mostly the embedding
            drafter.model.fc.weight.mul_(FC_NOISE)[:, :hidden].add_(torch.eye(hidden))
        process_weights_after_loading(drafter, spec.draft_model_config, torch.device("cpu"))
    del drafter.model.embed_tokens
    drafter.model.embed_tokens = target.model.model.embed_tokens
    drafter.lm_head = target.model.lm_head
    real.bind_caches(config, num_blocks)
    drafter_names = tuple(name for name in real.attention_layers(config) if name not in target_names)
    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(real.Model)}
    return Pair(Part(**fields, names=target_names),
                Part(config, drafter.eval(), num_blocks, target.block_size, names=drafter_names))


def forward(part: Part, step: real.Step, input_ids: torch.Tensor, positions: torch.Tensor,
            hidden: torch.Tensor | None = None, fn: Any = None) -> Any:
    """One forward of `part` under vLLM's forward context holding its own layers' metadata."""
    attn_metadata, slot_mapping = step.metadata(part)
    fn = fn or part.model
    args = (input_ids, positions) if hidden is None else (input_ids, positions, hidden)
    with torch.no_grad(), set_forward_context(attn_metadata, part.config, slot_mapping=slot_mapping):
        return fn(*args)


def greedy(part: Part, hidden: torch.Tensor) -> torch.Tensor:
    """The argmax token of each row (the LM head outside the compiled forward, as in vLLM)."""
    with torch.no_grad():
        return part.model.compute_logits(hidden).argmax(-1)


@dataclasses.dataclass
class Request:
    """A request's known tokens (prompt and generated), how many of them have KV, its drafts, and whether
    the target ever takes them (False: a plain decode request; the drafter still runs over it)."""

    tokens: list[int]
    computed: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)
    speculative: bool = True


@dataclasses.dataclass
class Record:
    """What one engine step did: each request's drafts used, accepted and proposed; the hidden states."""

    used: list[list[int]]
    accepted: list[list[int]]
    proposed: list[list[int]]
    target_hidden: torch.Tensor
    drafter_hidden: list[torch.Tensor]


def engine_step(pair: Pair, requests: list[Request], k_step: int, truncate: dict[int, int]) -> Record:
    """One step of vLLM's speculative loop over `requests` (batch order fixed: a request's index is its
    block-table row): the target's step, greedy acceptance, then `k_step` drafts per request (the
    first pass, then `k_step - 1` one-token steps). `truncate`: drafts a request may use this step."""
    query, used = [], []
    for i, req in enumerate(requests):
        pending = req.tokens[req.computed:]
        drafts = req.drafts[:truncate.get(i, K)] if req.speculative and len(pending) == 1 else []
        used.append(drafts)
        query.append(pending + drafts)
    step = real.Step([r.computed + len(q) for r, q in zip(requests, query)], [len(q) for q in query])
    ids = torch.tensor([t for q in query for t in q])
    hidden = forward(pair.target, step, ids, step.positions())
    argmax = greedy(pair.target, hidden).tolist()
    loc, sample, accepted, rejected, next_ids = 0, [], [], [], []
    for req, q, drafts in zip(requests, query, used):
        known = len(q) - len(drafts)
        start = loc + known - 1  # the row of the last known token: its argmax checks the first draft
        n = 0
        while n < len(drafts) and drafts[n] == argmax[start + n]:
            n += 1
        accepted.append(drafts[:n])
        rejected.append(len(drafts) - n)
        req.tokens.extend(drafts[:n] + [argmax[start + n]])  # the accepted drafts and the bonus token
        req.computed += known + n
        sample.append(start + n)
        next_ids.append(argmax[start + n])
        loc += len(q)
    proposed, drafter_hidden = propose(pair.drafter, step, ids, hidden, sample, next_ids, rejected, k_step)
    for req, drafts in zip(requests, proposed):
        req.drafts = drafts
    return Record(used, accepted, proposed, hidden, drafter_hidden)


def propose(drafter: Part, step: real.Step, target_ids: torch.Tensor, target_hidden: torch.Tensor,
            sample: list[int], next_ids: list[int], rejected: list[int], k_step: int
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """`EagleProposer.propose`, padded batch: the first pass over every target row, then `k_step - 1`
    one-token steps; each request's `k_step` drafts and the drafter's hidden states of each pass."""
    ids = torch.cat([target_ids[1:], target_ids[-1:]]).int()  # the proposer's int32 buffer, shifted
    ids[sample] = torch.tensor(next_ids, dtype=torch.int32)
    out, hidden = forward(drafter, step, ids, step.positions(), target_hidden)
    outputs = [out]
    rows = torch.tensor(sample)
    draft = greedy(drafter, out[rows])
    drafts = [draft]
    hidden = hidden[rows]
    seq_lens = [s - r for s, r in zip(step.seq_lens, rejected)]
    for _ in range(k_step - 1):
        seq_lens = [s + 1 for s in seq_lens]
        chain = real.Step(seq_lens, [1] * len(seq_lens))
        out, hidden = forward(drafter, chain, draft.int(), chain.positions(), hidden)
        outputs.append(out)
        draft = greedy(drafter, out)
        drafts.append(draft)
    return torch.stack(drafts, dim=1).tolist(), outputs


def compiled_and_eager(monkeypatch: Any, where: Path, options: dict | None = None, compile: bool = True,
                       **config: Any) -> list[Pair]:
    """The pair built twice (seed 3) under `where`: the first compiled (unless not `compile`: left to the
    caller, under compilation mode NONE as vLLM-Ascend runs), the target by vLLM's own mode-1 call (`vllm_real.compile_as_vllm`), the drafter by ours beside it
    (`compile_drafter`, what vLLM's mode 1 leaves out); the second eager. `options` go to
    ASCEND_COMPILE_OPTIONS."""
    from ascend_compile.integrations import vllm as integration

    if options is not None:
        monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps(options))
    pairs = []
    for name, mode in (("compiled", 1 if compile else 0), ("eager", 0)):
        path = where / name
        path.mkdir(exist_ok=True)
        pairs.append(build(vllm_config(path, compile_mode=mode, **config), seed=3))
    if not compile:
        return pairs
    real.compile_as_vllm(pairs[0].target)
    integration.compile_drafter(pairs[0].drafter.model, pairs[0].drafter.config)
    return pairs
