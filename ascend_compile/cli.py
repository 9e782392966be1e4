"""`ascend-compile inspect DUMP_DIR`: the compiler's decisions in a dump, as tables (or JSON)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from .passes.dump import PLAN_FILE


def _list(values: list) -> str:
    """A frozen host list in a table cell: whole when short, else its first entries and its length."""
    return str(values) if len(values) <= 4 else f"{str(values[:4])[:-1]}, ... ({len(values)} entries)]"


def find_plans(root: str) -> list[str]:
    """Every plan.json under `root`, in a stable order."""
    found = []
    for folder, _, files in os.walk(root):
        if PLAN_FILE in files:
            found.append(os.path.join(folder, PLAN_FILE))
    return sorted(found)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _render_piecewise(plan: dict[str, Any]) -> list[str]:
    """The piecewise graphs (sizes, pieces, what runs between them and why) and which path served each
    step kind."""
    pieces = plan.get("piecewise")
    if pieces is None:
        return []
    if not pieces["enabled"]:
        out = [f"\npiecewise graphs: none ({pieces['reason']})"]
    else:
        out = [f"\npiecewise graphs: sizes {pieces['sizes']}, kernels {', '.join(pieces['kernels'])}, "
               f"slot {pieces['workspace_slot']}"]
        rows = [(name, g["pieces"], g["eager_nodes"], "yes" if g["captured"] else "no", g["replays"],
                 "-" if "verified" not in g else "ok" if g["verified"]["ok"] else "DIFFERS: eager-only")
                for name, g in pieces["graphs"].items()]
        if rows:
            out.append(_table(["graph", "pieces", "eager nodes", "captured", "steps", "first step"], rows))
        why: dict[str, list[str]] = {}
        for node, reason in pieces.get("eager_nodes", {}).items():
            why.setdefault(reason, []).append(node)
        out.extend(f"run eagerly between pieces: {reason}: {len(nodes)} ({', '.join(nodes[:4])}"
                   f"{', ...' if len(nodes) > 4 else ''})" for reason, nodes in why.items())
    served = plan.get("served", {})
    if served.get("steps"):
        out.append("\nsteps served, by kind")
        paths = ("full", "piecewise", "eager")
        out.append(_table(["steps", *paths], [(kind, *(counts.get(p, 0) for p in paths))
                                               for kind, counts in served["steps"].items()]))
        out.extend(f"not a full graph ({n} steps): {why}" for why, n in served.get("not_full", {}).items())
    return out


def _render_startup(plan: dict[str, Any]) -> list[str]:
    """Where start-up went (the compile's phases, the captures) and the graph budget; the captures the
    device refused."""
    startup = plan.get("startup")
    if startup is None:
        return []
    out = ["\nstart-up: " + ", ".join(f"{name} {s:.2f} s" for name, s in startup["seconds"].items())
           + f", captures {startup['capture_seconds']:.2f} s ({len(startup['captures'])} graphs)"]
    budget = startup.get("graph_budget")
    if budget is not None:
        limit = budget["budget"] if budget["budget"] is not None else "none known"
        out.append(f"graphs to capture: {budget['graphs']} ({budget['full_graphs']} full, {budget['piecewise_sizes']} "
                   f"piecewise sizes x {budget['graphs_per_piecewise_size']} pieces); budget: {limit} "
                   f"({budget['budget_source']})")
        if budget.get("dropped_piecewise_sizes"):
            out.append(f"piecewise sizes dropped to fit the budget: {budget['dropped_piecewise_sizes']}")
    if "plan" in startup:  # a warm start's: answers taken from the persisted plan, and asked anew
        out.append(f"persisted plan {startup['plan']['file']}: reused {startup['plan']['reused']}, "
                   f"asked {startup['plan']['asked']}")
    out.extend(f"WARNING: capture refused by the device: {why}" for why in plan.get("failed_captures", {}).values())
    return out


def render(path: str, plan: dict[str, Any]) -> str:
    """One compiled graph's plan as text tables."""
    model = f"   model: {plan['model']}" if plan.get("model") else ""
    out = [f"== {os.path.dirname(path)}{model}", f"runtime: {plan.get('runtime', {}).get('name', '?')}   "
           f"buckets: {plan['buckets']}   tokens: {plan['tokens']}   max_blocks: {plan['max_blocks']}"]
    in_place = [i for i in plan["inputs"] if i["role"] in ("static", "kv_cache")]
    out.append("\ninputs the runner copies and pads (by role)")
    out.append(_table(["#", "name", "role", "shape"],
                      [(i["index"], i["name"], i["role"], i["shape"]) for i in plan["inputs"] if i not in in_place]))
    caches = sum(1 for i in in_place if i["role"] == "kv_cache")
    out.append(f"used in place (address-checked every step): {caches} KV caches, {len(in_place) - caches} weights/buffers")
    provided = plan.get("provided_inputs", [])
    if provided:
        out.append("\ninputs the runtime provides each step (read outside the graph)")
        out.append(_table(["input", "read from"], [(p["name"], p["source"]) for p in provided]))
    out.append(f"padding: {plan['padding']}")
    if "padding_sequences" in plan:
        out.append(f"padding sequences: {plan['padding_sequences']}")
    out.append("sizes: " + ", ".join(f"{sym} {kind}" for sym, kind in plan["symbols"].items()))
    writes = plan["input_writes"]
    if writes:
        out.append("\ninputs the graph writes (copied inputs are written back to the caller after each step)")
        out.append(_table(["input", "node", "padding-safe"],
                          [(w["input"], w["node"], "yes" if w["padding_safe"] else "no") for w in writes]))
    ws = plan["workspace"]
    out.append("\nworkspace slots" + (f" (pinned at length {ws['pinned_seq_len']})" if ws["pinned_seq_len"] else ""))
    out.append(_table(
        ["slot", "bytes", "argmax_len", "sized_for", "exact_bytes", "exact_argmax_len", "undersized"],
        [(n, s["nbytes"], s["argmax_len"], s["sized_for"], s["exact_nbytes"], s["exact_argmax_len"], s["undersized"])
         for n, s in ws["slots"].items()],
    ))
    schemes = ws["schemes_bytes"]
    out.append(f"schemes: shared {schemes['shared']} B, per-bucket {schemes['per_bucket']} B, per-layer {schemes['per_layer']} B")
    group = ws.get("group")
    if group:
        needs = ", ".join(f"{m['model']} {m['needs_bytes']} B" for m in group["members"])
        out.append(f"workspace group {group['name']}: one slot of {group['slot_bytes']} B for {needs}; a slot each "
                   f"would hold {group['separate_slots_bytes']} B (saved {group['saved_bytes']} B)")
    for warning in ws.get("warnings", []):
        out.append(f"WARNING: {warning}")
    rows = []
    for key, graph in plan["graphs"].items():
        kernels = {k["kernel"] for k in graph["kernels"]}
        reason = graph["kernels"][0]["reason"] if graph["kernels"] else ""
        captured = "update_table" in graph
        verified = graph.get("verified")
        check = "-" if verified is None else "ok" if verified["ok"] else "DIFFERS: eager-only"
        rows.append((key, graph["bucket"], "decode" if graph["decode"] else "mixed", ",".join(sorted(kernels)),
                     len(graph["kernels"]), graph["workspace_slot"], "yes" if captured else "no", check, reason))
    out.append("\ngraphs")
    out.append(_table(["graph", "bucket", "steps", "kernel", "nodes", "slot", "captured", "first replay", "reason"],
                      rows))
    served = {k["window_served"] for graph in plan["graphs"].values() for k in graph["kernels"] if "window_served" in k}
    out.extend(f"window: {how}" for how in sorted(served))
    for key, graph in plan["graphs"].items():
        for mismatch in (graph.get("verified") or {}).get("mismatches", []):
            out.append(f"WARNING: {key}: first replay differs from eager: {mismatch}")
    out.extend(_render_piecewise(plan))
    out.extend(_render_startup(plan))
    for key, graph in plan["graphs"].items():
        if "update_table" not in graph:
            continue
        if "specializations" in graph:
            out.append(f"\n{key} captured for specialized sizes: {', '.join(graph['specializations'])}")
        out.append(f"\nupdate table of {plan['model'] + ' ' if plan.get('model') else ''}{key}")
        out.append(_table(
            ["node", "kernel", "event", "refreshed from", "frozen at capture"],
            [(e["node"], e["kernel"], e["event"],
              ", ".join(f"{a}<-{r['input']}.{r['conversion']}" for a, r in e["refresh"].items()),
              "; ".join(f"{a}={_list(v)}" for a, v in e["frozen_at_capture"].items()))
             for e in graph["update_table"]],
        ))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ascend-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="render the plans of a dump directory")
    inspect.add_argument("dump_dir")
    inspect.add_argument("--json", action="store_true", help="print the plans as one JSON object")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dump_dir):
        print(f"ascend-compile: dump_dir: no such directory: {args.dump_dir}", file=sys.stderr)
        return 2
    plans = find_plans(args.dump_dir)
    if not plans:
        print(f"ascend-compile: dump_dir: no {PLAN_FILE} under {args.dump_dir}", file=sys.stderr)
        return 2
    loaded = {}
    for path in plans:
        with open(path) as f:
            loaded[os.path.relpath(os.path.dirname(path), args.dump_dir)] = json.load(f)
    if args.json:
        print(json.dumps(loaded, indent=2))
    else:
        print("\n\n".join(render(os.path.join(args.dump_dir, k, PLAN_FILE), v) for k, v in loaded.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
