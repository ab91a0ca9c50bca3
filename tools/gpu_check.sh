#!/usr/bin/env bash
# Device checks for a machine with a GPU: build the package with CUDA, run the gpu-marked tests,
# the argmax timing sweep against torch, a traced demo and, in the time left, the whole suite
# with the cuda backend active (`metrale-feed bench` records the host backend, on a GPU machine
# too: it is no device check). Logs, gpu_sweep.json and trace.json go to $OUT when it is set. The machine may be offline: PYTHON should name an
# interpreter whose environment already has scikit-build-core, cython, numpy, pytest, ml_dtypes
# (and torch for the comparisons).
# PYTHON picks the interpreter; GPU_CHECK_ARCHS (e.g. "90-real") narrows the CUDA build to save
# device time; GPU_CHECK_BUDGET (seconds, default one hour) bounds the whole run: every step runs
# under a timeout, so a hang costs its step, not the run, and the logs of what ran come back.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
budget="${GPU_CHECK_BUDGET:-3600}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

nvidia-smi -L 2>&1 | tee "$out/nvidia-smi.txt"

rc=0
# step NAME SECONDS LOG COMMAND...: run under a timeout (never past the budget), log it, time it.
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local left=$((budget - SECONDS - 5))
    [ "$limit" -gt "$left" ] && limit="$left"
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, out of time" | tee -a "$out/timings.txt"
        rc=1
        return 1
    fi
    echo "== $name (at most ${limit}s)"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$log"
    local status="${PIPESTATUS[0]}"
    echo "$name: exit $status in $((SECONDS - t0))s" | tee -a "$out/timings.txt"
    [ "$status" -eq 0 ] || rc=1
    return "$status"
}

# The machine may be offline: build with the tools already installed, fetch nothing.
if [ -n "${GPU_CHECK_ARCHS:-}" ]; then
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DMETRALE_FEED_CUDA_ARCHS=${GPU_CHECK_ARCHS}"
fi
if ! METRALE_FEED_CUDA=ON step build 900 pip.log "$py" -m pip install --no-build-isolation --no-deps -v . \
        >/dev/null; then
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

# A test that hangs fails by name with every thread's stack (pytest-timeout, where installed), and
# the run goes on to the next step; -v names each test as it ends.
per_test=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then
    per_test=(-p timeout --timeout "${GPU_CHECK_TEST_TIMEOUT:-60}" --timeout-method thread)
fi

step "pytest -m gpu" 300 pytest.log "$py" -m pytest -m gpu -v -rfE --durations=20 "${per_test[@]}" tests \
    --ignore=tests/tp/test_tp_gpu.py

# The tensor-parallel exchange on the cuda backend (NCCL, a world of one rank through the real
# partial, exchange and combine path, eager and replayed in a graph): run by name and verbosely,
# so a skip (a torch without CUDA or NCCL fails instead) shows in the log.
step "pytest tests/tp/test_tp_gpu.py (NCCL)" 120 pytest_tp_nccl.log \
    "$py" -m pytest -m gpu -v -rs tests/tp/test_tp_gpu.py

step gpu_sweep 150 gpu_sweep.txt env OUT="$out" METRALE_FEED_BACKEND=cuda "$py" tools/gpu_sweep.py

step "metrale-feed demo --trace" 60 demo.txt env METRALE_FEED_BACKEND=cuda \
    "$py" -m metrale_feed.tools.cli demo --quiet --trace "$out/trace.json" --host-work-us 200

# What time is left: the whole suite with the cuda backend active (the tests that do not pin the
# host or simt backend run on the device), failures listed, not stopped at the first.
step "pytest tests (cuda active)" 3600 pytest_all.log "$py" -m pytest -v -rfE --maxfail=40 "${per_test[@]}" \
    -p no:cacheprovider tests --ignore=tests/tp/test_tp_gpu.py -m "not slow"

echo "gpu_check: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
