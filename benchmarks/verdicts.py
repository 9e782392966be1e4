"""The GPU check's summary: the three targets' verdicts and the tables, from the phases' JSON files
(whatever of them a run left, cut or not), as Markdown for the README.

    python benchmarks/verdicts.py OUT_DIR        # prints it and writes OUT_DIR/summary.md

Targets (issue "Ready for the first GPU run"):
1. decode batch >= 32: `ascend_graph+inductor` at least 2x faster than the plain variant's best
   `torch.compile`, and within 1.5x of the HBM roofline (a device copy measured in the same run);
2. every batch: `ascend_graph+inductor` no slower than `reduce-overhead` on the same (op) model;
3. the PA kernel at batch 64 x context 4096: at least 70% of the device copy's bandwidth.
Needs no GPU and no torch.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any


def load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def decode_verdicts(decode: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(target 1 lines, target 2 lines) from the decode table."""
    if not decode:
        return ["NOT MEASURED (no decode table)"], ["NOT MEASURED (no decode table)"]
    by = {(r["variant"], r["mode"], r["batch"]): r for r in decode["rows"] if "median_ms" in r}
    batches = sorted({k[2] for k in by})
    first, second = [], []
    for batch in batches:
        ours = by.get(("op", "ascend_graph+inductor", batch))
        if ours is None:
            continue
        plain = {k[1]: by[k]["median_ms"] for k in by if k[0] == "plain" and k[1] != "eager" and k[2] == batch}
        if batch >= 32:
            if plain:
                best = min(plain, key=plain.get)
                speedup = plain[best] / ours["median_ms"]
                ok = speedup >= 2 and ours["x_roofline"] <= 1.5
                first.append(f"batch {batch}: {speedup:.2f}x faster than plain/{best} (of {', '.join(sorted(plain))}), "
                             f"{ours['x_roofline']:.2f}x roofline: {'PASS' if ok else 'FAIL'}")
            else:
                first.append(f"batch {batch}: NOT MEASURED (no plain torch.compile row)")
        ro = by.get(("op", "reduce-overhead", batch))
        if ro is not None:
            ratio = ours["median_ms"] / ro["median_ms"]
            second.append(f"batch {batch}: {ratio:.2f}x the time of op/reduce-overhead: {'PASS' if ratio <= 1 else 'FAIL'}")
    return first or ["NOT MEASURED (no ascend_graph+inductor row at batch >= 32)"], \
        second or ["NOT MEASURED (no ascend_graph+inductor and op/reduce-overhead rows)"]


def kernel_verdict(kernels: dict[str, Any] | None) -> list[str]:
    if not kernels:
        return ["NOT MEASURED (no kernel table)"]
    rows = [r for r in kernels["rows"] if r.get("case") == "pa" and r.get("batch") == 64 and r.get("context") == 4096
            and "of_copy" in r]
    if not rows:
        return ["NOT MEASURED (no PA row at batch 64 x 4096)"]
    r = rows[0]
    return [f"PA at batch 64 x 4096, {r['splits']} splits: {r['gbps']:.0f} GB/s, {r['of_copy']:.0%} of the copy: "
            f"{'PASS' if r['of_copy'] >= 0.7 else 'FAIL'}"]


def tests_section(tests: dict[str, Any] | None) -> list[str]:
    if not tests:
        return ["GPU tests: no results"]
    lines = ["GPU tests: " + ", ".join(f"{n} {k}" for k, n in sorted(tests.get("counts", {}).items()))]
    for r in tests["rows"]:
        if r["outcome"] == "failed":
            last = (r.get("error") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"- FAILED `{r['test']}`: {last[0][:300]}")
    return lines


def kernel_table(kernels: dict[str, Any] | None) -> list[str]:
    if not kernels:
        return []
    info = kernels["info"]
    lines = [f"Kernels ({info.get('device_name')}, torch {info.get('torch')}, triton {info.get('triton')}, "
             f"{info.get('dtype')}, shape {info.get('shape')}):", "",
             "| case | parameters | ms | GB/s | of copy | TFLOP/s |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in kernels["rows"]:
        params = ", ".join(f"{k}={v}" for k, v in r.items() if k in ("batch", "context", "splits", "tokens", "tile_rows"))
        if "gbps" not in r:
            lines.append(f"| {r['case']} | {params} | {r.get('skipped') or 'ERROR ' + r.get('error', '')} | | | |")
            continue
        tflops = f"{r['tflops']:.0f}" if "tflops" in r else ""
        ms = f"{r['ms']:.3f}" if "ms" in r else ""
        of_copy = f"{r['of_copy']:.0%}" if "of_copy" in r else ""
        lines.append(f"| {r['case']} | {params} | {ms} | {r['gbps']:.0f} | {of_copy} | {tflops} |")
    return lines


def decode_table(decode: dict[str, Any] | None) -> list[str]:
    if not decode:
        return []
    info = decode["info"]
    lines = [f"Decode steps (preset {info.get('preset')}: {info.get('layers')} layers, context {info.get('context')}, "
             f"{info.get('dtype')}; roofline at the measured copy, {info.get('copy_gbps', 0):.0f} GB/s, nominal "
             f"{info.get('nominal_gbps')}; plain SDPA backend: {info.get('sdpa_backend')}; {info.get('timing')}):", "",
             "| variant | mode | batch | median ms | x roofline | x nominal | max abs diff | first call s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in decode["rows"]:
        if "median_ms" not in r:
            lines.append(f"| {r['variant']} | {r['mode']} | | {r.get('skipped') or 'ERROR ' + r.get('error', '')[:120]} "
                         f"| | | | |")
            continue
        nominal = f"{r['x_nominal']:.2f}" if "x_nominal" in r else ""
        lines.append(f"| {r['variant']} | {r['mode']} | {r['batch']} | {r['median_ms']:.3f} | {r['x_roofline']:.2f} | "
                     f"{nominal} | {r['max_abs_diff']:.1e} | {r['first_call_s']:.1f} |")
    return lines


def summary(out_dir: str) -> str:
    tests = load(os.path.join(out_dir, "gpu_tests.json"))
    kernels = load(os.path.join(out_dir, "kernels.json"))
    decode = load(os.path.join(out_dir, "decode.json"))
    first, second = decode_verdicts(decode)
    lines = ["## GPU check", "", *tests_section(tests), "", "Targets:", "",
             "1. decode batch >= 32, ascend_graph+inductor >= 2x the best plain torch.compile and <= 1.5x roofline:",
             *[f"   - {line}" for line in first],
             "2. ascend_graph+inductor <= reduce-overhead on the op model:", *[f"   - {line}" for line in second],
             "3. PA kernel >= 70% of a device copy's bandwidth:", *[f"   - {line}" for line in kernel_verdict(kernels)],
             ""]
    for table in (kernel_table(kernels), decode_table(decode)):
        if table:
            lines += table + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    text = summary(args[0])
    print(text)
    with open(os.path.join(args[0], "summary.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
