"""A numpy oracle of vLLM v1's penalty rules, written from their definitions (dense arrays over
the whole vocabulary, as vLLM's apply_penalties and its logit processors compute them), not from
the package's rule: logit_bias, then min_tokens, then repetition, frequency and presence; a
finite logit that a stage would make infinite stops at the dtype's largest finite value (the
package's documented rule, docs/penalties.md)."""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - a test dependency
    ml_dtypes = None


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the logits' dtype stores them (round to nearest even), back in float32."""
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


def largest(dtype: str) -> np.float32:
    """The dtype's largest finite value, as a float32."""
    if dtype == "float32":
        return np.finfo(np.float32).max
    if dtype == "float16":
        return np.float32(np.finfo(np.float16).max)
    return np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def saturate(before, after, dtype):
    """A finite logit is never made infinite: past the dtype's largest finite value it stops
    there (what a penalty stage stores); one already infinite keeps the rule's result."""
    m = largest(dtype)
    return np.where(np.isfinite(before), np.clip(after, -m, m), after).astype(np.float32)


def penalize(logits, prompt, generated, *, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, logit_bias=None, min_tokens=0, stop_ids=(), dtype="float32"):
    """One row's logits (float32 values of `dtype`, the whole vocabulary) after the rules."""
    f32 = np.float32
    l = np.array(logits, np.float32, copy=True)
    vocab = l.shape[0]
    for token, bias in (logit_bias or {}).items():
        with np.errstate(over="ignore"):
            l[token] = saturate(l[token], f32(l[token]) + f32(bias), dtype)
    l = round_to(l, dtype)
    if len(generated) < min_tokens:
        for token in stop_ids:
            l[token] = -np.inf
    l = round_to(l, dtype)
    counts = np.bincount(np.asarray(list(generated), np.int64), minlength=vocab)[:vocab]
    out_mask = counts > 0
    prompt_mask = np.zeros(vocab, bool)
    prompt_mask[list(prompt)] = True
    rep = f32(repetition_penalty)
    before = l
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.where(l > 0, l / rep, l * rep).astype(np.float32)
        l = np.where(prompt_mask | out_mask, scaled, l).astype(np.float32)
        l = (l - f32(frequency_penalty) * counts.astype(np.float32)).astype(np.float32)
        l = (l - f32(presence_penalty) * out_mask.astype(np.float32)).astype(np.float32)
    return round_to(saturate(before, l, dtype), dtype)
