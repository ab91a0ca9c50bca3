"""sample_to_feed against numpy references written from the definitions (metrale_feed.testing.oracle):
temperature 0 is the argmax, draws are deterministic and row-independent, their distribution is
softmax(logit / T) renormalised over the survivors (chi-square), and never leaves them."""

import os
import subprocess
import sys

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_allowed, reference_argmax, reference_survivors

from helpers.calls import both_paths, sample
from helpers.chisq import chi2_critical


def test_params_dtype_is_32_bytes():
    assert mf.SAMPLING_PARAMS_DTYPE.itemsize == 32
    assert mf.SAMPLING_PARAMS_DTYPE.names[:6] == ("temperature", "top_p", "min_p", "top_k", "seed", "position")


def test_temperature_zero_is_the_argmax(host, dev):
    rng = np.random.default_rng(1)
    pool = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 1.0, np.inf, np.nan], np.float32)
    logits = pool[rng.integers(0, len(pool), (40, 37))]
    masks = rng.integers(0, 37, (40, 2)).astype(np.uint32)
    params = mf.sampling_params(40, temperature=0.0, top_k=3, top_p=0.5, seed=9)
    assert np.array_equal(sample(dev, logits, params, masks), reference_argmax(logits, masks))


def test_deterministic_and_independent_of_the_row(host, dev):
    rng = np.random.default_rng(2)
    rows, vocab = 16, 300
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    params = mf.sampling_params(rows, temperature=0.9, top_p=0.95, seed=rng.integers(0, 2**63, rows),
                                position=rng.integers(0, 1000, rows))
    first = sample(dev, logits, params)
    assert np.array_equal(first, sample(dev, logits, params))
    assert np.array_equal(first, sample(dev, logits, params, device_params=True))
    perm = rng.permutation(rows)
    assert np.array_equal(sample(dev, logits[perm], params[perm]), first[perm])
    # One request alone in a batch of one: the same id.
    assert sample(dev, logits[5:6], params[5:6])[0] == first[5]


def test_half_widths_draw_as_their_float32_widening(host, dev):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        logits = rng.standard_normal((8, 200)).astype(dtype)
        params = mf.sampling_params(8, temperature=1.3, top_k=50, seed=3, position=np.arange(8))
        assert np.array_equal(sample(dev, logits, params), sample(dev, logits.astype(np.float32), params))


FILTERS = [dict(temperature=0.7), dict(temperature=1.0, top_k=4), dict(temperature=1.0, top_p=0.6),
           dict(temperature=1.5, min_p=0.2), dict(temperature=0.8, top_k=7, top_p=0.85, min_p=0.05)]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("constrained", [False, True])
def test_draws_follow_the_renormalised_softmax(host, dev, filters, constrained):
    rng = np.random.default_rng(len(filters) * 10 + constrained)
    vocab, draws = 24, 4000
    row = rng.standard_normal(vocab).astype(np.float32)
    row[3] = np.nan
    row[9] = -np.inf
    masks = np.tile(np.array([[1, 17]], np.uint32), (draws, 1)) if constrained else None
    bitmask = None
    if constrained:
        words = np.full((draws, 1), 0xFFFFFFFF & ~(1 << 5) & ~(1 << 20), np.uint32)
        bitmask = words.view(np.int32)
    allowed = reference_allowed(masks[:1] if constrained else None,
                                bitmask[:1] if constrained else None, 1, vocab)[0]
    ids, probs = reference_survivors(row, allowed, **filters)
    params = mf.sampling_params(draws, seed=12345, position=np.arange(draws), **filters)
    got = sample(dev, np.tile(row, (draws, 1)), params, masks, bitmask)
    assert set(got.tolist()) <= set(ids.tolist()), "a draw outside the survivors"
    if len(ids) == 1:
        assert (got == ids[0]).all()
        return
    counts = np.array([(got == i).sum() for i in ids])
    expected = probs * draws
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < chi2_critical(len(ids) - 1), (chi2, counts, expected)


def test_no_candidate_is_no_token(host, dev):
    logits = np.array([[np.nan, np.inf, 1.0, 2.0]], np.float32)
    params = mf.sampling_params(1, temperature=1.0)
    assert sample(dev, logits, params, masks=[(2, 3)])[0] == mf.NO_TOKEN


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", np.nan),
                                         ("temperature", np.inf), ("top_p", 0.0), ("top_p", 1.5),
                                         ("min_p", 1.0), ("min_p", -0.1)])
def test_bad_params_raise_before_queueing(host, dev, field, value):
    logits = dev.upload(np.zeros((2, 10), np.float32))
    cells = mf.DeviceBuffer(8)
    dst = np.full(2, 5, np.uint32)
    params = mf.sampling_params(2, temperature=1.0)
    params[1][field] = value
    with pytest.raises(ValueError):
        mf.sample_to_feed(logits, params, cells, dst, None, vocab=10, dtype="float32")
    mf.stream_synchronize(0)
    assert (dst == 5).all()
    with pytest.raises(TypeError):
        mf.sample_to_feed(logits, np.zeros(2, np.float32), cells, dst, None, vocab=10, dtype="float32")
    with pytest.raises(ValueError):
        mf.sample_to_feed(logits, mf.sampling_params(1), cells, dst, None, rows=2, vocab=10, dtype="float32")
    logits.close()
    cells.close()


FTZ_CHILD = r"""
import ctypes, mmap, sys
import numpy as np
# ldmxcsr from a 4-byte argument: mov [rsp-4], edi; ldmxcsr [rsp-4]; ret
code = bytes([0x89, 0x7C, 0x24, 0xFC, 0x0F, 0xAE, 0x54, 0x24, 0xFC, 0xC3])
mem = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
mem.write(code)
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
ctypes.CFUNCTYPE(None, ctypes.c_uint32)(addr)(0x1F80 | 0x8040)  # defaults + FTZ + DAZ
tiny = np.array([1e-45], np.float32)
assert (tiny * np.float32(1.0))[0] == 0.0, "DAZ did not take effect"
import metrale_feed as mf
logits = np.array(eval(sys.argv[1]), np.uint32).view(np.float32)  # bits: no FP op to flush
rows, vocab = logits.shape
out = []
for portable in (False, True):
    mf.host_argmax_path(portable)
    dev = mf.DeviceBuffer(logits.nbytes); mf.copy_h2d_async(dev, logits)
    cells = mf.DeviceBuffer(rows * 4); dst = np.zeros(rows, np.uint32)
    with mf.Event() as ev:
        mf.argmax_to_feed(dev, None, cells, dst, ev, rows=rows, vocab=vocab, dtype="float32")
        ev.synchronize()
        out.append(dst.tolist())
        p = mf.sampling_params(rows, temperature=1e-38, seed=1)
        mf.sample_to_feed(dev, p, cells, dst, ev, vocab=vocab, dtype="float32"); ev.synchronize()
        out.append(dst.tolist())
print(out)
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"),
                    reason="sets MXCSR with x86-64 machine code")
def test_rule_holds_with_ftz_and_daz():
    """With FTZ/DAZ set in the process, subnormal logits still compare as numbers (argmax on both
    paths) and the sampler's arithmetic is unchanged."""
    rows = [[0.0, 1e-45, 3e-45, 2e-45, -1e-45] + [0.0] * 20, [-3e-45, -1e-45, -2e-45] + [-1.0] * 20 + [0.0, 0.0]]
    logits = np.array(rows, np.float32)
    want = reference_argmax(logits).tolist()
    env = dict(os.environ, METRALE_FEED_BACKEND="host")
    bits = logits.view(np.uint32).tolist()
    done = subprocess.run([sys.executable, "-c", FTZ_CHILD, repr(bits)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    got = eval(done.stdout.strip())
    assert got[0] == want and got[2] == want, (got, want)  # the AVX2 path, the portable path
    assert got[1] == got[3]  # the sampler: the same draw on both (its arithmetic ignores the mode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_draws_are_the_host_kernels_bits(dev, dtype):
    """The CUDA kernel and the host kernel give the same ids on random logits and params (the
    rule is one header; no libm, no fused ops, integer sums)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    rows, vocab = 64, 5000
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if dtype == "bfloat16":
        logits = logits.astype(ml_dtypes.bfloat16)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.2, 2.0, rows), top_k=rng.integers(0, 50, rows),
                                top_p=rng.uniform(0.3, 1.0, rows), min_p=rng.uniform(0.0, 0.2, rows),
                                seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**31, rows))
    bitmask = (rng.integers(0, 2**32, (rows, (vocab + 31) // 32), dtype=np.uint64) | 1).astype(np.uint32).view(np.int32)
    on_gpu = sample(dev, logits, params, bitmask=bitmask)
    mf.set_backend("host")
    try:
        on_host = sample(dev, logits, params, bitmask=bitmask)
    finally:
        mf.set_backend("cuda")
    assert np.array_equal(on_gpu, on_host)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_vector_and_portable_paths_draw_the_same(host, dev, scale, dtype):
    """The AVX2 helpers only decide what to skip (and repeat the rule's exp for top_p masses):
    the ids must be the portable path's, filters on and off, masks and bitmask included."""
    rng = np.random.default_rng(int(scale))
    rows, vocab = 48, 3001
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    logits[rng.integers(0, rows, 20), rng.integers(0, vocab, 20)] = np.nan
    logits[rng.integers(0, rows, 20), rng.integers(0, vocab, 20)] = np.inf
    if dtype != "float32":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        logits = logits.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.3, 2.0, rows),
                                top_k=np.where(rng.random(rows) < 0.3, rng.integers(1, 100, rows), 0),
                                top_p=np.where(rng.random(rows) < 0.5, rng.uniform(0.2, 1.0, rows), 1.0),
                                min_p=np.where(rng.random(rows) < 0.3, rng.uniform(0, 0.3, rows), 0.0),
                                seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**31, rows))
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    bitmask = rng.integers(-2**31, 2**31, (rows, (vocab + 31) // 32)).astype(np.int32)
    vector, portable = both_paths(dev, logits, params, masks, bitmask)
    assert np.array_equal(portable, vector)
    assert (portable != mf.NO_TOKEN).all()


def test_the_mixin_samples_through_sample_to_feed(host, dev):
    """RuntimeFeedMixin.sample_batch_to_feed: temperature 0 is its argmax_batch_to_feed, and a
    sampled step equals sample_to_feed on the same inputs."""

    class Model(mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
        pass

    rng = np.random.default_rng(8)
    rows, vocab = 6, 500
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    masks = [(mf.NO_TOKEN, mf.NO_TOKEN)] * rows
    model = Model()
    model.init_device_feed(vocab=vocab, max_rows=8)
    buf = dev.upload(logits)
    dst = np.zeros(rows, np.uint32)
    try:
        with mf.Event() as done:
            model.argmax_batch_to_feed(buf, masks, dst, done, 0)
            done.synchronize()
            greedy = dst.copy()
            model.sample_batch_to_feed(buf, mf.sampling_params(rows, temperature=0.0), masks, dst, done, 0)
            done.synchronize()
            assert np.array_equal(dst, greedy) and np.array_equal(greedy, reference_argmax(logits))
            params = mf.sampling_params(rows, temperature=1.0, top_p=0.8, seed=4, position=np.arange(rows))
            model.sample_batch_to_feed(buf, params, masks, dst, done, 0)
            done.synchronize()
        assert model.feed_prev_rows == rows
        assert np.array_equal(dst, sample(dev, logits, params))
    finally:
        buf.close()
        model.close_device_feed()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the vector helpers are x86-64 AVX2 code")
def test_vector_helpers_are_the_scalar_rule_bit_for_bit(tmp_path):
    """The AVX2 Philox and exp of the host sampler against philox.h and sample_rule.h (compiled
    here from tests/c/sample_vectors.cpp with the flags the library uses)."""
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build tests/c/sample_vectors.cpp")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = tmp_path / "sample_vectors"
    build = subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off",
                            f"-I{root}/cuda/include", f"-I{root}/cuda/src", f"-I{root}/cuda/src/host",
                            f"{root}/tests/c/sample_vectors.cpp", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    if done.returncode == 77:
        pytest.skip("this CPU has no AVX2")
    assert done.returncode == 0 and "mismatches 0" in done.stdout, done.stdout + done.stderr


def test_step_records_build_each_rows_record_from_its_params():
    """The one batch builder (plain and speculative steps) against records made field by field
    with ``sampling_params``; ``position`` is left 0 for the scheduler."""
    from metrale_feed.params import SAMPLING_FIELDS
    from metrale_feed.sampling import ROW_FIELDS, sampling_params, step_records

    assert set(ROW_FIELDS) == {"temperature", "top_k", "top_p", "min_p", "seed"}
    assert set(ROW_FIELDS) <= set(SAMPLING_FIELDS)
    rows = [mf.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=11),
            mf.SamplingParams(),
            mf.SamplingParams(temperature=2.0, seed=2**63 - 1, repetition_penalty=1.2)]
    want = sampling_params(3, temperature=[0.7, 0.0, 2.0], top_k=[5, 0, 0],
                           top_p=[0.9, 1.0, 1.0], min_p=[0.05, 0.0, 0.0],
                           seed=[11, 0, 2**63 - 1], position=0)
    got = step_records(rows)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert step_records([]).shape == (0,)
