"""Speculative decoding, standalone: a draft model proposes k tokens a request, the target checks them in one step.

    python -m examples.speculative [--requests 4] [--k 3] [--tokens 24] [--runtime sim]

Both models are compiled with `ascend_compile.compile` in one process, each with its own KV cache, in one
workspace group (`workspace_group`): their steps never run at once, so they share one attention-workspace
slot, sized for the larger need of the two, and one device graph pool. A
round, per request: the drafter takes the tokens its cache lacks (the last one, and the one before
when every proposal of the round before was accepted) and proposes `k` tokens greedily, one decode
step each; the target takes the last token and the `k` proposals in one step (1 + k query tokens a
request: a mixed step) and keeps the proposals up to the first that differs from its own greedy
choice, plus its own next token. The drafter is the target's first layers with its embedding and
head (layer skipping). Rows a rejected proposal wrote in either cache sit past
the request's length and are written anew before any step reads them.

The result is checked token-equal to plain greedy decoding of the target, run eagerly. Printed: each
round's proposed and accepted tokens, and per draft step the drafter's launches (replays, task
updates and any launch outside a graph, from its artifact's stats) and the runner's own host
microseconds (`seconds["host"]`: the step's work outside the device's phases), and the bytes of the shared
workspace slot against a slot each.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any, Callable, Sequence

import torch

import ascend_compile
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from examples.llama import LlamaConfig, LlamaDecoder, build


@dataclasses.dataclass
class Request:
    """One request: its tokens (prompt and generated), its cache blocks, and how many leading
    positions each model's cache holds."""

    tokens: list[int]
    blocks: list[int]
    target_len: int = 0
    draft_len: int = 0


def step_inputs(cfg: LlamaConfig, feeds: Sequence[tuple[Request, int, Sequence[int]]]) -> dict[str, torch.Tensor]:
    """A step's inputs: for each (request, first position, tokens), the tokens at consecutive positions."""
    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    for request, first, tokens in feeds:
        for i, token in enumerate(tokens):
            p = first + i
            ids.append(token)
            pos.append(p)
            slots.append(request.blocks[p // cfg.block_size] * cfg.block_size + p % cfg.block_size)
        starts.append(starts[-1] + len(tokens))
        lens.append(first + len(tokens))
        tables.append(request.blocks)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64), "positions": torch.tensor(pos, dtype=torch.int64),
        "block_table": torch.tensor(tables, dtype=torch.int32), "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32), "slot_mapping": torch.tensor(slots, dtype=torch.int64),
    }


def drafter_of(target: LlamaDecoder, cfg: LlamaConfig, layers: int) -> LlamaDecoder:
    """The target's first `layers` layers with its embedding, final norm and head: a model of its own
    (its own KV cache)."""
    draft = LlamaDecoder(dataclasses.replace(cfg, num_layers=layers))
    own = draft.state_dict()
    own.update({k: v for k, v in target.state_dict().items() if k in own})
    draft.load_state_dict(own)
    return draft.eval()


def new_requests(cfg: LlamaConfig, prompts: Sequence[Sequence[int]], max_len: int, seed: int) -> list[Request]:
    per_request = -(-max_len // cfg.block_size)
    free = random.Random(seed).sample(range(cfg.num_blocks), per_request * len(prompts))
    return [Request(list(p), free[i * per_request:(i + 1) * per_request]) for i, p in enumerate(prompts)]


def greedy(model: Callable[..., torch.Tensor], cfg: LlamaConfig, prompts: Sequence[Sequence[int]], new: int,
           max_len: int) -> list[list[int]]:
    """Plain greedy decoding: `new` tokens a request, one decode step each."""
    requests = new_requests(cfg, prompts, max_len, seed=1)
    logits = model(**step_inputs(cfg, [(r, 0, r.tokens) for r in requests]))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    for r, token in zip(requests, logits[ends].argmax(-1).tolist()):
        r.tokens.append(token)
    for _ in range(new - 1):
        logits = model(**step_inputs(cfg, [(r, len(r.tokens) - 1, r.tokens[-1:]) for r in requests]))
        for r, token in zip(requests, logits.argmax(-1).tolist()):
            r.tokens.append(token)
    return [r.tokens[len(p):] for r, p in zip(requests, prompts)]


def speculative(target: Callable[..., torch.Tensor], draft: Callable[..., torch.Tensor], cfg: LlamaConfig,
                prompts: Sequence[Sequence[int]], new: int, k: int, max_len: int,
                on_round: Callable[[list[list[int]], list[int]], None] = lambda proposed, accepted: None
                ) -> list[list[int]]:
    """Greedy speculative decoding of at least `new` tokens a request (the first `new` returned)."""
    requests = new_requests(cfg, prompts, max_len, seed=1)
    prefill = step_inputs(cfg, [(r, 0, r.tokens) for r in requests])
    logits = target(**prefill)
    draft(**prefill)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    for r, token in zip(requests, logits[ends].argmax(-1).tolist()):
        r.tokens.append(token)
        r.target_len = r.draft_len = len(r.tokens) - 1
    while min(len(r.tokens) - len(p) for r, p in zip(requests, prompts)) < new:
        proposals: list[list[int]] = [[] for _ in requests]
        for j in range(k):  # the drafter's steps: the tokens its cache lacks, then each proposal
            feeds = [(r, r.draft_len, r.tokens[r.draft_len:]) if j == 0 else (r, len(r.tokens) - 1 + j, [p[-1]])
                     for r, p in zip(requests, proposals)]
            logits = draft(**step_inputs(cfg, feeds))
            rows = torch.tensor([len(f[2]) for f in feeds]).cumsum(0) - 1
            for p, token in zip(proposals, logits[rows].argmax(-1).tolist()):
                p.append(token)
        logits = target(**step_inputs(cfg, [(r, len(r.tokens) - 1, [r.tokens[-1], *p]) for r, p in zip(requests, proposals)]))
        choices = logits.argmax(-1).view(len(requests), k + 1).tolist()
        accepted = []
        for r, p, choice in zip(requests, proposals, choices):
            m = next((i for i in range(k) if p[i] != choice[i]), k)
            n = len(r.tokens)
            r.tokens.extend(choice[:m + 1])  # the accepted proposals (equal to its choices) and its next token
            r.target_len, r.draft_len = n + m, n + min(m, k - 1)
            accepted.append(m)
        on_round(proposals, accepted)
    return [r.tokens[len(p):len(p) + new] for r, p in zip(requests, prompts)]


#: The longest sequence both models are compiled for, as a server's context bound (their workspaces are sized
#: for every length up to it: the reference PA splits a sequence's keys past 256, using its workspace).
MAX_MODEL_LEN = 1024

#: Rounds before the drafter's figures are counted: its graphs are captured by then.
WARM_UP_ROUNDS = 2


def compiled(model: torch.nn.Module, runtime: str, max_len: int, sizes: tuple[int, ...], name: str, group: str
             ) -> tuple[Any, list]:
    """`model` compiled as `name` in workspace group `group`: the target and the drafter, whose steps never
    run at once (one thread, one stream), share one workspace slot and one device graph pool."""
    artifacts: list = []
    config = CompileConfig(max_model_len=max_len, capture_sizes=sizes, runtime=runtime, model_name=name,
                           workspace_group=group)
    return ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append)), artifacts


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens a request")
    parser.add_argument("--draft-layers", type=int, default=3, help="the target's first layers the drafter keeps")
    parser.add_argument("--runtime", default="sim")
    args = parser.parse_args(argv)
    cfg = LlamaConfig(num_layers=4, num_blocks=64)
    max_len = 256  # the longest a request grows here (its cache blocks)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(5, 40))] for _ in range(args.requests)]
    target_model = build(cfg)
    draft_model = drafter_of(target_model, cfg, args.draft_layers)
    with torch.no_grad():
        expected = greedy(build(cfg), cfg, prompts, args.tokens, max_len)  # eager, a cache of its own
        group = f"speculative-{id(draft_model):x}"  # this run's pair only
        target, target_arts = compiled(target_model, args.runtime, MAX_MODEL_LEN, (4, 8, 16, 32), "target", group)
        draft, draft_arts = compiled(draft_model, args.runtime, MAX_MODEL_LEN, (4, 8), "drafter", group)
        rounds: list[tuple[int, int]] = []
        counts: list[dict[str, float]] = []  # the drafter's totals after the warm-up rounds, and at the end

        def totals() -> dict[str, float]:
            keys = ("steps", "replays", "updates", "launches_outside_graph", "captures")
            out = {key: float(sum(a.stats[key] for a in draft_arts)) for key in keys}
            return {**out, "host": sum(a.seconds["host"] for a in draft_arts)}

        def round_done(proposed: list[list[int]], accepted: list[int]) -> None:
            rounds.append((sum(map(len, proposed)), sum(accepted)))
            print(f"round {len(rounds):2d}: proposed {[len(p) for p in proposed]}, accepted {accepted}")
            if len(rounds) == WARM_UP_ROUNDS:
                counts.append(totals())

        got = speculative(target, draft, cfg, prompts, args.tokens, args.k, max_len, round_done)
    counts.append(totals())
    first, last = counts if len(counts) == 2 else (totals(), totals())
    delta = {key: last[key] - first[key] for key in last}
    steps = max(delta["steps"], 1)
    result = {
        "token_equal": got == expected, "rounds": len(rounds), "proposed": sum(p for p, _ in rounds),
        "accepted": sum(a for _, a in rounds), "draft_steps": int(delta["steps"]),
        "draft_replays": int(delta["replays"]), "draft_outside_graph": int(delta["launches_outside_graph"]),
        "draft_captures": int(delta["captures"]),
        "launches_per_draft_step": (delta["replays"] + delta["updates"] + delta["launches_outside_graph"]) / steps,
        "host_us_per_draft_step": delta["host"] / steps * 1e6,
        "target_replays": sum(a.stats["replays"] for a in target_arts),
    }
    shared = target_arts[0].group.describe()
    result["workspace"] = {"slot_bytes": shared["slot_bytes"], "separate_slots_bytes": shared["separate_slots_bytes"],
                           "saved_bytes": shared["saved_bytes"],
                           "needs_bytes": {m["model"]: m["needs_bytes"] for m in shared["members"]}}
    print(f"token-equal to plain greedy decoding of the target: {result['token_equal']}; accepted "
          f"{result['accepted']} of {result['proposed']} proposals in {result['rounds']} rounds")
    print(f"drafter, after {WARM_UP_ROUNDS} rounds: {result['draft_steps']} steps, {result['draft_replays']} replays, {result['launches_per_draft_step']:.1f} "
          f"launches a step (one replay and its task updates; {result['draft_outside_graph']} outside graphs), "
          f"{result['host_us_per_draft_step']:.0f} us of the runner's host work a step")
    print(f"workspace: one slot of {shared['slot_bytes']} bytes for the target and the drafter; a slot each would "
          f"hold {shared['separate_slots_bytes']} bytes (saved {shared['saved_bytes']})")
    return result


if __name__ == "__main__":
    main()
