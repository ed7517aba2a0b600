"""Token sampling in NumPy, resumable by construction, in O(vocabulary).

The random draw of step ``n`` comes from a generator seeded with
``(seed, n)``, so the sampler has no hidden state: a generation parked after
step ``n`` and resumed anywhere draws exactly what it would have drawn.

Nothing sorts the vocabulary. A step computes the weights ``exp((x - max) / T)``
once (float32), keeps the candidates that ``top_k``, ``top_p`` and ``min_p``
allow, and draws by inverting the cumulative weight in vocabulary order: one
uniform number, block sums (float64) to find the block of 512 tokens it
falls in, a cumulative sum inside that block. ``top_k`` is a partial
selection; ``top_p`` a selection by mass (it sorts a few thousand candidates
at most).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SamplingParams", "TokenLogprob", "logprobs_of", "sample", "token_counts"]

#: Tokens per block of the two-level cumulative sum.
_BLOCK = 512
#: Largest finite float32: the scale of a temperature too small for float32.
_MAX_SCALE = float(np.finfo(np.float32).max)
#: Candidates few enough for top_p's selection to sort.
_SORTED = 2048
#: top_p first sorts this many of the best candidates (most nuclei are smaller).
_FIRST_TRY = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    #: OpenAI's penalties: subtracted from a token's logit once if it was
    #: generated at all (presence), and once per time it was (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Token id (as text, as JSON has it) -> bias added to its logit.
    logit_bias: dict[str, float] = field(default_factory=dict)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def adjusted(self, logits: np.ndarray, counts: Mapping[int, int]) -> np.ndarray:
        """``logits`` after the bias and the penalties (a copy; the input if none
        applies). ``counts`` is how often each token has been generated so far
        (kept by the caller as tokens come, not recounted), so a resumed
        generation adjusts exactly as the uninterrupted one did."""
        if not (self.logit_bias or self.penalized):
            return logits
        out = logits.astype(np.float32, copy=True)
        for token, bias in self.logit_bias.items():
            out[int(token)] += bias
        if counts and self.penalized:
            tokens = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            times = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            out[tokens] -= (self.presence_penalty + self.frequency_penalty * times).astype(
                np.float32
            )
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def token_counts(generated: list[int]) -> Counter[int]:
    """How often each token occurs in ``generated`` (the penalties' input)."""
    return Counter(generated)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    """Pick the next token from raw ``logits`` at generation step ``step``.

    The draw depends only on ``logits``, ``params`` and ``(params.seed, step)``.
    Logits with a NaN, or with no finite value (a grammar that allows no
    token), are a ``ValueError``: the job fails, nothing is drawn from them.
    """
    x = np.asarray(logits, dtype=np.float32)
    best = x.max()
    if not np.isfinite(best):
        raise ValueError("the logits hold a NaN or no finite value: nothing to sample from")
    if params.greedy:
        return int(np.argmax(x))
    scale = np.float32(min(1.0 / params.temperature, _MAX_SCALE))
    weights = x - best  # one array of the vocabulary's size, worked in place
    with np.errstate(over="ignore", invalid="ignore"):
        # A tiny temperature sends every token but the best to -inf (weight 0).
        weights *= scale
    np.exp(weights, out=weights)
    ids: np.ndarray | None = None  # None: every token, in vocabulary order
    n = weights.shape[0]
    if 0 < params.top_k < n:
        ids = np.sort(np.argpartition(weights, n - params.top_k)[n - params.top_k :])
    if params.top_p < 1.0:
        ids = _nucleus(weights, ids, params.top_p)
    if params.min_p > 0.0:
        # The best token's weight is exp(0) = 1: min_p of it is min_p.
        if ids is None:
            weights = np.where(weights >= np.float32(params.min_p), weights, np.float32(0))
        else:
            ids = ids[weights[ids] >= np.float32(params.min_p)]
    rng = np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, step])
    if ids is None:
        return _draw_dense(weights, rng.random())
    return int(ids[_draw(weights[ids], rng.random())])


def _nucleus(weights: np.ndarray, ids: np.ndarray | None, top_p: float) -> np.ndarray:
    """The best candidates (among ``ids``, or all) whose probability adds up to
    ``top_p``: those at or above the weight where the running mass, from the best
    down, reaches it (tokens tied at that weight are all kept). In vocabulary
    order."""
    pool = weights if ids is None else weights[ids]
    target = top_p * float(pool.sum(dtype=np.float64))
    n = pool.shape[0]
    if n > _FIRST_TRY:
        # Most steps' nucleus is small: the best few hundred, sorted, reach it.
        best = np.sort(np.partition(pool, n - _FIRST_TRY)[n - _FIRST_TRY :])[::-1]
        reached = np.cumsum(best, dtype=np.float64)
        cut = best[int(np.searchsorted(reached, target))] if reached[-1] >= target else None
    else:
        cut = None
    if cut is None:
        cut = _mass_threshold(pool, target)
    chosen = np.flatnonzero(pool >= cut)
    return chosen if ids is None else ids[chosen]


def _mass_threshold(pool: np.ndarray, target: float) -> np.float32:
    """The largest weight ``t`` with ``sum(pool[pool >= t]) >= target``: a
    selection by mass (quickselect on a sampled median pivot, expected O(n)),
    sorting only the last few candidates."""
    above = 0.0  # the mass of what is known to be kept
    cand = pool
    floor = np.float32(pool.min()) if pool.size else np.float32(0)
    while cand.size > _SORTED:
        pivot = np.float32(np.median(cand[:: max(1, cand.size // 255)]))
        higher = cand[cand > pivot]
        mass = float(higher.sum(dtype=np.float64))
        if above + mass >= target:
            cand = higher
            continue
        above += mass
        at = float(np.count_nonzero(cand == pivot)) * float(pivot)
        if above + at >= target:
            return pivot
        above += at
        floor = pivot
        cand = cand[cand < pivot]
    if cand.size == 0:
        return floor
    best = np.sort(cand)[::-1]
    reached = above + np.cumsum(best, dtype=np.float64)
    return np.float32(best[min(int(np.searchsorted(reached, target)), best.size - 1)])


def _draw(weights: np.ndarray, u: float) -> int:
    """Invert the cumulative weight at ``u`` of the total (a few candidates)."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    at = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    # Rounding can put u at the very end: the last candidate with weight.
    return min(at, int(np.flatnonzero(weights)[-1]))


def _draw_dense(weights: np.ndarray, u: float) -> int:
    """:func:`_draw` over the whole vocabulary: block sums, then one block."""
    n = weights.shape[0]
    whole = n - n % _BLOCK
    sums = weights[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    cumulative = np.cumsum(sums)
    target = u * cumulative[-1]
    block = min(int(np.searchsorted(cumulative, target, side="right")), sums.shape[0] - 1)
    while sums[block] == 0.0:  # rounding at a block's edge: the nearest block with weight
        block -= 1
    below = float(cumulative[block - 1]) if block else 0.0
    start = block * _BLOCK
    inner = weights[start : start + _BLOCK]
    at = int(np.searchsorted(np.cumsum(inner, dtype=np.float64), target - below, side="right"))
    return int(start + min(at, int(np.flatnonzero(inner)[-1])))


def logprobs_of(logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """The model's log-probability of ``token`` and of its ``top_n`` best alternatives."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = x.shape[0]
        k = min(top_n, n)
        idx = np.argpartition(x, n - k)[n - k :] if k < n else np.arange(n)
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = tuple((int(i), float(x[i]) - lse) for i in idx)
    return TokenLogprob(token, float(x[token]) - lse, top)
