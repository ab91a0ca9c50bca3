"""An exact numpy statement of speculative verification (verify_to_feed) for the tests, written
from the rules in docs/kernels.md ("Sampling", "Verify"), not from the C code.

It recomputes every bit the kernels compute: Philox4x32-10, the float32 exp/log polynomials (one
IEEE float32 operation at a time: numpy never fuses), the integer masses, the filters' packed
thresholds and the exponential race. ``sample_ids`` is then sample_to_feed's draw and
``verify_rows`` verify_to_feed's cells; the tests check the first against the package, so the
oracle is itself checked before it judges the verifier.
"""

from __future__ import annotations

import numpy as np

from metrale_feed.testing.oracle import NO_TOKEN

F = np.float32
U32 = 0xFFFFFFFF


def philox(c0, c1, c2, c3, seed: int):
    """Philox4x32-10 of counter words (uint64 arrays holding 32-bit values) under ``seed``."""
    c = [np.asarray(x, np.uint64) & np.uint64(U32) for x in (c0, c1, c2, c3)]
    k0, k1 = seed & U32, (seed >> 32) & U32
    for rnd in range(10):
        if rnd:
            k0, k1 = (k0 + 0x9E3779B9) & U32, (k1 + 0xBB67AE85) & U32
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(U32),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(U32)]
    return c


def race_bits(seed: int, position: int, ids) -> np.ndarray:
    """The race's 32 random bits of each id: block (v / 4, position, 0, 0), word v % 4."""
    ids = np.asarray(ids, np.uint64)
    words = philox(ids >> np.uint64(2), np.full(ids.shape, position & U32), 0, 0, seed)
    out = np.zeros(ids.shape, np.uint64)
    for w in range(4):
        out = np.where((ids & np.uint64(3)) == w, words[w], out)
    return out.astype(np.uint32)


def accept_bits(seed: int, position: int) -> int:
    """The accept uniform's bits: block (0, position, 1, 0), word 0."""
    return int(philox(0, position & U32, 1, 0, seed)[0])


def exp_neg(x) -> np.ndarray:
    """exp(x) for x <= 0, the rule's Cody-Waite polynomial in float32; 0 below 2**-125 or NaN."""
    x = np.asarray(x, F)
    with np.errstate(all="ignore"):
        n = np.floor(x * F(1.44269502) + F(0.5))
        r = (x - n * F(0.693145751953125)) - n * F(1.42860677e-06)
        p = F(1.38888889e-03)
        for c in (8.33333333e-03, 4.16666667e-02, 1.66666667e-01, 0.5, 1.0, 1.0):
            p = p * r + F(c)
        k = np.where(np.isfinite(n), n, 0).astype(np.int64)
        bits = (np.asarray(p, F).view(np.int32).astype(np.int64) + k * (1 << 23)) & U32
        out = bits.astype(np.uint32).view(F)
    return np.where((x >= F(-86.0)) & (k >= -125), out, F(0.0)).astype(F)


def log_pos(x) -> np.ndarray:
    """log(x) for positive normal float32 x, the rule's atanh series."""
    x = np.asarray(x, F)
    bits = x.view(np.uint32).astype(np.int64)
    e = (bits >> 23) - 127
    mant = bits & 0x7FFFFF
    big = mant > 0x3504F3
    mant = np.where(big, mant | (126 << 23), mant | (127 << 23))
    e = np.where(big, e + 1, e)
    m = mant.astype(np.uint32).view(F)
    s = (m - F(1.0)) / (m + F(1.0))
    z = s * s
    q = F(0.111111111)
    for c in (0.142857143, 0.2, 0.333333333, 1.0):
        q = q * z + F(c)
    logm = (F(2.0) * s) * q
    fe = e.astype(F)
    return fe * F(0.693145751953125) + (logm + fe * F(1.42860677e-06))


def gumbel(seed: int, position: int, ids) -> np.ndarray:
    u = ((race_bits(seed, position, ids) >> np.uint32(8)).astype(F) + F(0.5)) * F(5.96046448e-08)
    return -log_pos(-log_pos(u))


def key_f32(values) -> np.ndarray:
    """The ordered key of float32 values (NaN lowest, -0.0 == +0.0), as int64."""
    bits = np.asarray(values, F).view(np.uint32).astype(np.int64)
    mag = bits & 0x7FFFFFFF
    key = np.where(bits >> 31, 0x80000000 - mag, 0x80000000 + mag)
    key = np.where(mag == 0, 0x80000000, key)
    return np.where(mag > 0x7F800000, 0, key)


def packed(keys, ids) -> np.ndarray:
    """(key << 32) | ~id as Python-int-safe uint64."""
    return (np.asarray(keys, np.uint64) << np.uint64(32)) | (~np.asarray(ids, np.uint64) & np.uint64(U32))


def as_f32(row) -> np.ndarray:
    """A row widened exactly to float32 (float16 and bfloat16 embed exactly)."""
    return np.asarray(row).astype(np.float32)


class Target:
    """One position's sampled distribution as the kernels state it: the candidates, zmax, the
    survivors of top_k, top_p and min_p, and each survivor's integer mass."""

    def __init__(self, row, allowed, p):
        v = as_f32(row)
        self.vocab = v.size
        self.temperature = F(p["temperature"])
        self.inv_t = F(1.0) / self.temperature
        self.seed, self.position = int(p["seed"]), int(p["position"])
        with np.errstate(all="ignore"):
            self.z = (v * self.inv_t).astype(F)
        cand = np.flatnonzero(np.asarray(allowed) & np.isfinite(v))
        self.cand = cand
        if cand.size == 0:
            self.top = None
            return
        pk = packed(key_f32(v[cand]), cand)
        self.top = int(cand[np.argmax(pk)])
        self.zmax = self.z[self.top]
        self.hot = not np.isfinite(self.zmax)
        if self.hot:
            return
        with np.errstate(all="ignore"):
            e = exp_neg(self.z[cand] - self.zmax)
        mass = (e * F(549755813888.0)).astype(np.int64)
        threshold = 0
        top_k, top_p, min_p = int(p["top_k"]), F(p["top_p"]), F(p["min_p"])
        order = np.argsort(pk)[::-1]  # greatest packed first
        if top_k and cand.size > top_k:
            threshold = int(pk[order[top_k - 1]])
        if F(0.0) < top_p < F(1.0):
            keep = order[pk[order] >= np.uint64(threshold)]
            weights = [int(mass[i]) for i in keep]
            total = sum(weights)
            frac = int(top_p * F(4294967296.0))
            target = max(1, -(-total * frac // (1 << 32)))
            run = 0
            for i, w in zip(keep, weights):
                if w == 0:
                    continue
                run += w
                if run >= target:
                    threshold = int(pk[i])
                    break
        alive = pk >= np.uint64(threshold)
        if F(0.0) < min_p < F(1.0):
            alive &= e >= min_p
        self.surv = cand[alive]
        self.mass = dict(zip(self.surv.tolist(), mass[alive].tolist()))

    def race(self, skip=None) -> int:
        """The exponential race over the survivors other than ``skip``."""
        ids = self.surv[self.surv != skip] if skip is not None else self.surv
        if ids.size == 0:
            return NO_TOKEN
        score = (self.z[ids] + gumbel(self.seed, self.position, ids)).astype(F)
        return int(ids[np.argmax(packed(key_f32(score), ids))])

    def draw(self) -> int:
        """sample_to_feed's id."""
        if self.top is None:
            return NO_TOKEN
        return self.top if self.hot else self.race()

    def accepts(self, x: int) -> bool:
        """The speculative rule's accept decision for a one-hot draft x."""
        if self.hot:
            return x == self.top
        m, total = self.mass.get(x, 0), sum(self.mass.values())
        u = accept_bits(self.seed, self.position) >> 8
        return m != 0 and (2 * u + 1) * total < m * (1 << 25)


    def accepts_q(self, x: int, qx: float) -> bool:
        """min(1, p(x) / q(x)): U * q(x) < p(x) in float64 (q sanitised: not finite and > 0 is 0)."""
        px = self.p_of(x)
        u = float(((accept_bits(self.seed, self.position) >> 8) + 0.5) * 2.0**-24)
        return px > 0.0 and u * sane_q(qx) < px

    def p_of(self, v: int) -> float:
        return float(np.float64(self.mass.get(v, 0)) / np.float64(sum(self.mass.values())))

    def residual_race(self, q) -> int:
        """The race over the positive float32 weights max(0, p - q), else the race over p."""
        ids = self.surv
        total = np.float64(sum(self.mass.values()))
        w = np.array([np.float64(self.mass[v]) / total - sane_q(q[v]) for v in ids.tolist()]).astype(F)
        keep = w >= F(1.17549435e-38)
        if not keep.any():
            return self.race()
        ids, w = ids[keep], w[keep]
        score = (log_pos(w) + gumbel(self.seed, self.position, ids)).astype(F)
        return int(ids[np.argmax(packed(key_f32(score), ids))])


def sane_q(q) -> float:
    q = np.float32(q)
    return float(q) if F(0.0) < q <= F(3.4e38) else 0.0


def at_position(p, j: int):
    q = p.copy()
    q["position"] = (int(p["position"]) + j) & U32
    return q


def greedy(p) -> bool:
    return p is None or not (0.0 < float(p["temperature"]) <= 3.4e38)


def sample_ids(logits, allowed, params) -> np.ndarray:
    """sample_to_feed's ids for rows of logits (allowed: (rows, vocab) bool)."""
    out = np.zeros(len(logits), np.uint32)
    for r in range(len(logits)):
        if greedy(params[r]):
            out[r] = masked_argmax(logits[r], allowed[r])
        else:
            out[r] = Target(logits[r], allowed[r], params[r]).draw()
    return out


def masked_argmax(row, allowed) -> int:
    """The argmax rule over the allowed ids (NaN lowest, ties to the lower id)."""
    v = as_f32(row)
    ids = np.flatnonzero(allowed)
    if ids.size == 0:
        return NO_TOKEN
    return int(ids[np.argmax(packed(key_f32(v[ids]), ids))])


def verify_rows(logits, allowed, drafts, k: int, params=None, draft_probs=None) -> np.ndarray:
    """verify_to_feed's cells, (rows, k + 2): n, the emitted ids, NO_TOKEN padding.

    logits: (rows * (k + 1), vocab); allowed: (rows * (k + 1), vocab) bool; drafts (rows, k);
    draft_probs: None (one-hot drafts) or (rows * k, vocab) float32."""
    drafts = np.asarray(drafts, np.int64).reshape(-1, k)
    rows = drafts.shape[0]
    cells = np.full((rows, k + 2), NO_TOKEN, np.uint32)
    for r in range(rows):
        x = drafts[r]
        d = int(np.argmax(x == NO_TOKEN)) if (x == NO_TOKEN).any() else k
        p = None if params is None else params[r]
        ids = []
        for j in range(d + 1):
            lr = r * (k + 1) + j
            draft = int(x[j]) if j < d else None
            if greedy(p):
                t = masked_argmax(logits[lr], allowed[lr])
                if draft is not None and draft == t:
                    ids.append(draft)
                    continue
                ids.append(t)
                break
            target = Target(logits[lr], allowed[lr], at_position(p, j))
            if draft is None or target.top is None:
                ids.append(target.draw())
                break
            if draft_probs is None or target.hot:
                if target.accepts(draft):
                    ids.append(draft)
                    continue
                ids.append(target.top if target.hot else target.race(skip=draft))
                break
            q = draft_probs[r * k + j]
            if target.accepts_q(draft, q[draft]):
                ids.append(draft)
                continue
            ids.append(target.residual_race(q))
            break
        cells[r, 0] = len(ids)
        cells[r, 1 : 1 + len(ids)] = ids
    return cells
