#!/usr/bin/env bash
# Device checks for a machine with a GPU: build the package with CUDA, run the gpu-marked tests,
# the argmax timing sweep against torch, `metrale-feed bench` and a traced demo. Logs,
# gpu_sweep.json, bench.json and trace.json go to $OUT when it is set. The machine may be
# offline: PYTHON should name an interpreter whose environment already has scikit-build-core,
# cython, numpy, pytest, ml_dtypes (and torch for the comparisons).
# PYTHON picks the interpreter; GPU_CHECK_ARCHS (e.g. "90-real") narrows the CUDA build to save
# device time.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"

nvidia-smi -L 2>&1 | tee "$out/nvidia-smi.txt"

# The machine may be offline: build with the tools already installed, fetch nothing.
if [ -n "${GPU_CHECK_ARCHS:-}" ]; then
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DMETRALE_FEED_CUDA_ARCHS=${GPU_CHECK_ARCHS}"
fi
echo "== pip install (METRALE_FEED_CUDA=ON)"
if ! METRALE_FEED_CUDA=ON "$py" -m pip install --no-build-isolation --no-deps -v . \
        >"$out/pip.log" 2>&1; then
    tail -n 60 "$out/pip.log"
    echo "gpu_check: build failed (full log in $out/pip.log)"
    exit 1
fi

# gpu tests skip quietly unless the cuda backend is active: make that loud here.
backend="$("$py" -c 'import metrale_feed as m; print(m.backend())' 2>&1)"
echo "== backend: $backend"
if [ "$backend" != "cuda" ]; then
    echo "gpu_check: the cuda backend is not active"
    exit 1
fi

rc=0
echo "== pytest -m gpu"
"$py" -m pytest -m gpu -q tests --ignore=tests/tp/test_tp_gpu.py 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

# The tensor-parallel exchange on the cuda backend (NCCL, a world of one rank through the real
# partial, exchange and combine path, eager and replayed in a graph): run by name and verbosely,
# so a skip (a torch without CUDA or NCCL fails instead) shows in the log.
echo "== pytest tests/tp/test_tp_gpu.py (NCCL)"
"$py" -m pytest -m gpu -v -rs tests/tp/test_tp_gpu.py 2>&1 | tee "$out/pytest_tp_nccl.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== gpu_sweep"
OUT="$out" METRALE_FEED_BACKEND=cuda "$py" tools/gpu_sweep.py 2>&1 | tee "$out/gpu_sweep.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== metrale-feed bench"
METRALE_FEED_BACKEND=cuda "$py" -m metrale_feed.tools.cli bench --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== metrale-feed demo --trace"
METRALE_FEED_BACKEND=cuda "$py" -m metrale_feed.tools.cli demo --quiet --trace "$out/trace.json" \
    --host-work-us 200 2>&1 | tee "$out/demo.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "gpu_check: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
