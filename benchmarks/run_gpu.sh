#!/usr/bin/env bash
# The GPU check, in one command that fits one 10-minute call on an H200 (torch and triton already
# installed, no internet). Four phases, each cut at its time budget (the script then goes on), each
# printing and writing its rows to $OUT as it measures them, so even a cut run returns figures:
#
#   1. GPU tests       tests/test_cuda_gpu.py and the Triton kernel tests of tests/test_triton_kernels.py
#                      and tests/test_triton_mla.py, two pytest processes side by side; a row per test in
#                      gpu_tests.json as it ends
#   2. kernels         benchmarks/gpu_kernels.py: a device-to-device copy (the roofline), then the PA,
#                      FIA and MLA kernels' bandwidth and the prefill tiles vs FlashAttention (kernels.json)
#   3. decode table    benchmarks/decode.py --preset h200: one decode step, every compile mode, the
#                      target comparisons first (decode.json)
#   4. piecewise       benchmarks/piecewise.py --device cuda: a 512-token prefill step above the buckets,
#                      eager against CUDA-graph pieces, checked against eager first (piecewise.json)
#
# then benchmarks/verdicts.py writes summary.md: the three targets' verdicts and the tables.
#
#   bash benchmarks/run_gpu.sh              # everything (default OUT=benchmarks/results)
#   bash benchmarks/run_gpu.sh --dry-run    # the phases, their commands and budgets; runs nothing, needs no CUDA
#   PHASES="2 3" bash benchmarks/run_gpu.sh # some phases; P1_S=... P2_S=... P3_S=... P4_S=... change their budgets
#
# $OUT receives at most 7 files (the device tool returns 8): run.log, gpu_tests.log, gpu_tests.json,
# kernels.json, decode.json, piecewise.json, summary.md.
#
# Time on an H200 (estimates: the kernels have never run on one). Triton compiles a variant of
# these kernels in ~1-2 s on one core; inductor compiles a 4-layer model in ~20-30 s with its
# worker pool; a timed step or kernel call takes milliseconds.
#   setup     ~15 s   pip install -e (no deps), torch import, device line              budget 30 s
#   phase 1  ~150 s   test_cuda_gpu.py: 9 kernel-vs-reference cases (~6 compiles each) ~70 s, two
#                     small compiled models (dynamo + inductor) ~40 s, graph replays; MLA: 4 kernel
#                     cases against the CPU reference (~4 compiles each, the reference on the CPU)
#                     and two DeepSeek-style models ~40 s; in parallel the ~70 Triton kernel tests
#                     (~60 compiles) ~110 s                                              budget 180 s
#   phase 2   ~50 s   ~18 compiles, ~16 timed cases of 20 calls, 1 GiB copy             budget 75 s
#   phase 3  ~200 s   two 4-layer models; eager modes ~10 s; ascend_graph+inductor (3 bucket graphs)
#                     ~50 s; reduce-overhead on each variant ~50 s each (batch 1 compiles apart); the
#                     modes after these start only within the first 90 s                 budget 180 s
#   phase 4   ~40 s   an 8-layer model compiled twice (dynamo ~5 s each), 9 pieces captured, 20 timed
#                     steps each                                                         budget 60 s
#   summary    ~1 s
#   total    ~7 min expected; at most 30 + 180 + 75 + 180 + 60 + ~5 = ~8.8 min when every phase is cut.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
if [ "$#" -gt 0 ]; then echo "usage: bash benchmarks/run_gpu.sh [--dry-run]" >&2; exit 2; fi

OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python3}"
PHASES="${PHASES:-1 2 3 4}"
SETUP_S=30
P1_S="${P1_S:-180}"
P2_S="${P2_S:-75}"
P3_S="${P3_S:-180}"
P4_S="${P4_S:-60}"
# Soft budgets inside the phases: no new benchmark case / mode once spent, so a phase ends by itself
# before its hard budget (a mode's compiles take up to ~90 s).
P2_SOFT=$((P2_S - 25))
P3_SOFT=$((P3_S - 90))

PYTEST="$PY -m pytest -q -rfE -p no:cacheprovider -p pytest_rows"
P1A="$PYTEST tests/test_cuda_gpu.py"
# the kernel tests run compiled on the GPU; the model-level ones are CPU checks (CI runs them)
P1B="$PYTEST tests/test_triton_kernels.py tests/test_triton_mla.py -k 'not (model or inductor or backend)'"
P2="$PY benchmarks/gpu_kernels.py --json $OUT/kernels.json --budget-s $P2_SOFT"
P3="$PY benchmarks/decode.py --preset h200 --json $OUT/decode.json --budget-s $P3_SOFT"
P4="$PY benchmarks/piecewise.py --device cuda --layers 8 --tokens 512 --rounds 20 --json $OUT/piecewise.json"
SUMMARY="$PY benchmarks/verdicts.py $OUT"

if [ "$DRY_RUN" = 1 ]; then
    echo "GPU check (dry run): phases [$PHASES], results in $OUT"
    echo "setup:   budget ${SETUP_S}s, estimate ~15s: pip install -e . --no-deps; torch/triton/device line"
    echo "phase 1: GPU tests, budget ${P1_S}s, estimate ~150s (two processes side by side)"
    echo "    $P1A"
    echo "    $P1B"
    echo "phase 2: kernel bandwidth, budget ${P2_S}s (no new case after ${P2_SOFT}s), estimate ~50s"
    echo "    $P2"
    echo "phase 3: decode table, budget ${P3_S}s (no new mode after ${P3_SOFT}s), estimate ~200s"
    echo "    $P3"
    echo "phase 4: piecewise prefill, budget ${P4_S}s, estimate ~40s"
    echo "    $P4"
    echo "summary: estimate ~1s"
    echo "    $SUMMARY"
    echo "total: estimate ~7 min, at most $((SETUP_S + P1_S + P2_S + P3_S + P4_S + 5))s with every phase cut"
    exit 0
fi

mkdir -p "$OUT"
rm -f "$OUT"/gpu_tests.json "$OUT"/gpu_tests*.log "$OUT"/kernels.json "$OUT"/decode.json "$OUT"/piecewise.json \
    "$OUT"/summary.md
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, and pytest_rows
export GPU_TESTS_JSON="$OUT/gpu_tests.json"
START=$SECONDS
stamp() { echo "== [$((SECONDS - START))s] $*"; }

stamp "setup"
# The package from this checkout, without downloading anything (for the "ascend_graph" entry point;
# PYTHONPATH covers the rest). INSTALL=0 skips it (a shared environment whose install must stay).
if [ "${INSTALL:-1}" != 0 ]; then
    timeout "$SETUP_S" "$PY" -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 \
        || echo "pip install -e . failed or timed out: using PYTHONPATH"
fi
timeout "$SETUP_S" "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    || echo "torch/triton/CUDA check failed"

status=0
run_phase() {  # run_phase NAME BUDGET COMMAND: the command cut at its budget; its exit status noted
    local name=$1 budget=$2 cmd=$3 rc
    stamp "$name (budget ${budget}s): $cmd"
    timeout -k 10 "$budget" bash -c "$cmd"
    rc=$?
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "$name: cut at its budget of ${budget}s"
    stamp "$name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

if [[ " $PHASES " == *" 1 "* ]]; then
    stamp "phase 1: GPU tests (budget ${P1_S}s, two processes)"
    timeout -k 10 "$P1_S" bash -c "$P1A" >"$OUT/gpu_tests_cuda.log" 2>&1 &
    pid_a=$!
    timeout -k 10 "$P1_S" bash -c "$P1B" >"$OUT/gpu_tests_triton.log" 2>&1 &
    pid_b=$!
    wait "$pid_a"; rc_a=$?
    wait "$pid_b"; rc_b=$?
    for part in cuda triton; do
        sed "s/^/[$part] /" "$OUT/gpu_tests_$part.log" >>"$OUT/gpu_tests.log" && rm -f "$OUT/gpu_tests_$part.log"
    done
    grep -E "^\[(cuda|triton)\] (FAILED|ERROR|.* in [0-9.]+s)" "$OUT/gpu_tests.log" | tail -20
    for rc in $rc_a $rc_b; do
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "phase 1: a pytest process was cut at its budget of ${P1_S}s"
        [ "$rc" -eq 0 ] || status=1
    done
    stamp "phase 1: exit $rc_a (test_cuda_gpu) $rc_b (test_triton_kernels, test_triton_mla)"
fi
[[ " $PHASES " == *" 2 "* ]] && run_phase "phase 2: kernels" "$P2_S" "$P2"
[[ " $PHASES " == *" 3 "* ]] && run_phase "phase 3: decode table" "$P3_S" "$P3"
[[ " $PHASES " == *" 4 "* ]] && run_phase "phase 4: piecewise prefill" "$P4_S" "$P4"

stamp "summary"
$SUMMARY || status=1
stamp "done: exit $status; results in $OUT"
exit "$status"
