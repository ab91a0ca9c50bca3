#!/usr/bin/env bash
# Sanitizers for the host and simt backends:
#  1. the C layer and the _core extension built with AddressSanitizer and UBSan into a venv of
#     their own, and a subset of the host-backend tests run under them, then the kernels' tests on
#     the simt backend (the CUDA kernels themselves: any out-of-bounds access of theirs is caught);
#  2. the C layer alone (cmake, no Python) linked into tests/c/feed_smoke.c (host, then simt), run
#     under valgrind;
#  3. the extension rebuilt with ThreadSanitizer, and the thread tests run under it, then the simt
#     tests whose blocks run on several threads at once (arrival counters, the last-block combine).
# Exits non-zero on any sanitizer or valgrind report, or any failing test.
#
#   tools/sanitize.sh            # all three
#   tools/sanitize.sh asan       # or: valgrind, tsan
#
# METRALE_FEED_SANITIZE_DIR: where the venv and builds go (default build/sanitize in the repo).
# METRALE_FEED_SANITIZE_TESTS: the pytest arguments of step 1 (default below).
# METRALE_FEED_SANITIZE_VENV: a venv that has the build's and the tests' needs already, to build
#   into (default: one of its own in the work folder, made on first use).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
work=${METRALE_FEED_SANITIZE_DIR:-$root/build/sanitize}
what=${1:-all}
mkdir -p "$work"
work=$(cd "$work" && pwd)

# Host-backend tests that exercise the C layer the most; those that compile or install wheels
# (test_cimport, test_capi, test_symbols) would run compilers under the preloaded runtime.
default_tests="tests/test_runtime.py tests/test_argmax.py tests/test_router.py tests/test_reference.py
tests/hostile tests/test_faults.py tests/test_threads.py tests/test_properties.py tests/test_soak.py
tests/test_bitmask.py tests/test_sampling.py tests/test_logprobs.py"
tests=${METRALE_FEED_SANITIZE_TESTS:-$default_tests}
# The tests with threads racing on handles, streams and copies (a few minutes under TSan).
tsan_tests=${METRALE_FEED_TSAN_TESTS:-"tests/test_threads.py"}
# The kernels on the simt backend: under ASan (scaled to the executor's speed under ASan), and
# the parallel block mode under TSan.
simt_asan_tests=${METRALE_FEED_SIMT_ASAN_TESTS:-"tests/simt tests/test_reference.py tests/test_bitmask.py"}
simt_asan_select=${METRALE_FEED_SIMT_ASAN_SELECT:-"not 40000 and not 20000"}
simt_tsan_select=${METRALE_FEED_SIMT_TSAN_SELECT:-"parallel"}

venv=${METRALE_FEED_SANITIZE_VENV:-$work/venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "scikit-build-core>=0.10" "cython>=3.0" ninja cmake \
        numpy pytest hypothesis ml_dtypes
fi
py="$venv/bin/python"
cmake_bin="$venv/bin/cmake"

status=0
reports="$work/reports.txt"
: > "$reports"

run_asan() {
    local san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
    local start=$SECONDS
    echo "sanitize: building the extension with $san"
    # Python_add_library makes a MODULE: its link flags are CMAKE_MODULE_LINKER_FLAGS.
    (cd "$root" && METRALE_FEED_CUDA=OFF "$py" -m pip install -q --no-build-isolation --force-reinstall --no-deps \
        -Cbuild-dir="$work/build-asan" \
        -Ccmake.define.CMAKE_C_FLAGS="$san" \
        -Ccmake.define.CMAKE_CXX_FLAGS="$san" \
        -Ccmake.define.CMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
        -Ccmake.define.CMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" .)
    echo "sanitize: built in $((SECONDS - start)) s"

    local asan_lib
    asan_lib=$(gcc -print-file-name=libasan.so)
    [ -e "$asan_lib" ] || { echo "sanitize: libasan.so not found (gcc -print-file-name)"; return 1; }
    local files=()
    for t in $tests; do files+=("$root/$t"); done
    local log="$work/pytest-asan.log"
    start=$SECONDS
    echo "sanitize: running ${#files[@]} test files under ASan + UBSan"
    # Outside the repository, so the installed (instrumented) package is imported. Leak checks
    # are off: the interpreter itself does not free everything at exit. Huge allocations are
    # refused with NULL, as malloc does, since tests ask for them on purpose. ASan's quarantine
    # keeps freed memory resident, so the soak's RSS bound is lifted (its live counts still
    # hold). -s lets in-process reports reach the log; the child interpreters of
    # test_hostile.py inherit the environment, and a report there fails the case it ran.
    # Two workers where pytest-xdist is installed: a report kills its worker (halt_on_error), which
    # fails the test it ran, and each worker's report reaches the log through -s's stderr.
    local workers=()
    if "$py" -c "import xdist" 2>/dev/null; then workers=(-n 2); fi
    set +e
    (cd "$work" && \
        LD_PRELOAD="$asan_lib" \
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:print_stacktrace=1" \
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
        METRALE_FEED_BACKEND=host METRALE_FEED_SOAK_STEPS="${METRALE_FEED_SOAK_STEPS:-2000}" \
        METRALE_FEED_SOAK_RSS_BOUND=$((1 << 30)) \
        PYTHONFAULTHANDLER=1 \
        "$py" -m pytest -q -s -p no:cacheprovider "${workers[@]}" "${files[@]}") > "$log" 2>&1
    local rc=$?
    local simt_files=()
    for t in $simt_asan_tests; do simt_files+=("$root/$t"); done
    echo "sanitize: the kernels' tests on the simt backend under ASan + UBSan" >> "$log"
    (cd "$work" && \
        LD_PRELOAD="$asan_lib" \
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:print_stacktrace=1" \
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
        METRALE_FEED_BACKEND=simt PYTHONFAULTHANDLER=1 \
        "$py" -m pytest -q -s -p no:cacheprovider -k "$simt_asan_select" "${simt_files[@]}") >> "$log" 2>&1
    local simt_rc=$?
    [ "$rc" -ne 0 ] || rc=$simt_rc
    set -e
    tail -n 15 "$log"
    echo "sanitize: tests ran in $((SECONDS - start)) s (pytest exit $rc); log: $log"
    if grep -E "ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$log" >> "$reports"; then
        echo "sanitize: ASan/UBSan reports (see $log)"
        status=1
    fi
    [ "$rc" -eq 0 ] || status=1
}

run_valgrind() {
    command -v valgrind >/dev/null || { echo "sanitize: valgrind is not installed"; return 1; }
    local build="$work/build-c" start=$SECONDS
    echo "sanitize: building the C layer (cmake, no Python) and tests/c/feed_smoke.c"
    "$cmake_bin" -S "$root" -B "$build" -G Ninja -DMETRALE_FEED_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
        -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" > "$work/cmake-c.log"
    "$cmake_bin" --build "$build" --target metrale_feed_c >> "$work/cmake-c.log"
    local lib
    lib=$(find "$build" -name 'libmetrale_feed_c.a' | head -n 1)
    gcc -std=c11 -g -O1 -Wall -Wextra -Werror -I"$root/cuda/include" -c "$root/tests/c/feed_smoke.c" \
        -o "$build/feed_smoke.o"
    g++ -g -o "$build/feed_smoke" "$build/feed_smoke.o" "$lib" -pthread -lm -ldl
    echo "sanitize: C build in $((SECONDS - start)) s"
    start=$SECONDS
    local log="$work/valgrind.log"
    set +e
    # Definite and indirect leaks are errors; "possibly lost" is not: the host backend's stream
    # workers and kernel helpers are detached threads still alive at exit, by design.
    valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect \
        --show-leak-kinds=definite,indirect "$build/feed_smoke" > "$log" 2>&1
    local rc=$?
    set -e
    tail -n 12 "$log"
    echo "sanitize: valgrind run in $((SECONDS - start)) s (exit $rc); log: $log"
    if [ "$rc" -ne 0 ]; then
        echo "valgrind: exit $rc" >> "$reports"
        status=1
    fi
}

run_tsan() {
    local san="-fsanitize=thread -fno-omit-frame-pointer -g"
    local start=$SECONDS
    echo "sanitize: building the extension with $san"
    (cd "$root" && METRALE_FEED_CUDA=OFF "$py" -m pip install -q --no-build-isolation --force-reinstall --no-deps \
        -Cbuild-dir="$work/build-tsan" \
        -Ccmake.define.CMAKE_BUILD_TYPE=RelWithDebInfo \
        -Ccmake.define.CMAKE_C_FLAGS="$san" \
        -Ccmake.define.CMAKE_CXX_FLAGS="$san" \
        -Ccmake.define.CMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
        -Ccmake.define.CMAKE_MODULE_LINKER_FLAGS="-fsanitize=thread" .)
    echo "sanitize: built in $((SECONDS - start)) s"
    local tsan_lib
    tsan_lib=$(gcc -print-file-name=libtsan.so)
    [ -e "$tsan_lib" ] || { echo "sanitize: libtsan.so not found (gcc -print-file-name)"; return 1; }
    local files=()
    for t in $tsan_tests; do files+=("$root/$t"); done
    local log="$work/pytest-tsan.log"
    start=$SECONDS
    echo "sanitize: running ${#files[@]} test files under ThreadSanitizer"
    # The interpreter is not instrumented, but its locks (the GIL) are seen through TSan's
    # pthread interceptors, so Cython code serialised by the GIL is not reported. Child
    # interpreters inherit the preload, so a race in one fails the test that ran it.
    set +e
    (cd "$work" && \
        LD_PRELOAD="$tsan_lib" \
        TSAN_OPTIONS="halt_on_error=1:exitcode=66:report_signal_unsafe=0:second_deadlock_stack=1:suppressions=$root/tools/tsan.supp" \
        METRALE_FEED_BACKEND=host PYTHONFAULTHANDLER=1 \
        "$py" -m pytest -q -s -p no:cacheprovider "${files[@]}") > "$log" 2>&1
    local rc=$?
    (cd "$work" && \
        LD_PRELOAD="$tsan_lib" \
        TSAN_OPTIONS="halt_on_error=1:exitcode=66:report_signal_unsafe=0:second_deadlock_stack=1:suppressions=$root/tools/tsan.supp" \
        METRALE_FEED_BACKEND=host PYTHONFAULTHANDLER=1 \
        "$py" -m pytest -q -s -p no:cacheprovider -k "$simt_tsan_select" "$root/tests/simt/test_simt_exact.py") >> "$log" 2>&1
    local simt_rc=$?
    [ "$rc" -ne 0 ] || rc=$simt_rc
    set -e
    tail -n 15 "$log"
    echo "sanitize: tests ran in $((SECONDS - start)) s (pytest exit $rc); log: $log"
    if grep -E "WARNING: ThreadSanitizer|SUMMARY: ThreadSanitizer" "$log" >> "$reports"; then
        echo "sanitize: ThreadSanitizer reports (see $log)"
        status=1
    fi
    [ "$rc" -eq 0 ] || status=1
}

case "$what" in
    all) run_asan || status=1; run_valgrind || status=1; run_tsan || status=1 ;;
    asan) run_asan || status=1 ;;
    valgrind) run_valgrind || status=1 ;;
    tsan) run_tsan || status=1 ;;
    *) echo "usage: $0 [all|asan|valgrind|tsan]"; exit 2 ;;
esac

if [ "$status" -ne 0 ]; then
    echo "sanitize: FAILED"
    [ -s "$reports" ] && head -n 20 "$reports"
else
    echo "sanitize: clean"
fi
exit "$status"
