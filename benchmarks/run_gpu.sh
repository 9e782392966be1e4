#!/usr/bin/env bash
# One command on a CUDA machine with torch and triton already installed (no internet needed): the
# GPU tests, then the full decode benchmark (preset "small"). Results go to $OUT (default
# benchmarks/results): gpu_tests.log, decode_small.txt, decode_small.json.
#
#   bash benchmarks/run_gpu.sh                 # extra arguments go to benchmarks/decode.py
#   RUN_TESTS=0 bash benchmarks/run_gpu.sh     # the benchmark only (RUN_BENCH=0: the tests only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
# The package from this checkout, without downloading anything; PYTHONPATH if pip cannot install it.
if ! python3 -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/install.log" 2>&1; then
    echo "pip install -e . failed (see $OUT/install.log): using PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

tests_rc=0
if [ "${RUN_TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_gpu.py tests/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
fi
bench_rc=0
if [ "${RUN_BENCH:-1}" != 0 ]; then
    python3 benchmarks/decode.py --preset small --json "$OUT/decode_small.json" "$@" 2>&1 | tee "$OUT/decode_small.txt"
    bench_rc=${PIPESTATUS[0]}
fi
echo "gpu tests: exit $tests_rc; benchmark: exit $bench_rc; results in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
