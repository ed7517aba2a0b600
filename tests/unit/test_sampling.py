from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from jobs.engine.sampling import SamplingParams, logprobs_of, sample, token_counts


def _logits(seed: int = 0, n: int = 100) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_greedy_takes_the_argmax() -> None:
    x = _logits()
    assert sample(x, SamplingParams(temperature=0.0), step=3) == int(np.argmax(x))


def test_seeded_draws_depend_only_on_seed_and_step() -> None:
    x = _logits()
    p = SamplingParams(temperature=0.9, seed=1234)
    first = [sample(x, p, s) for s in range(50)]
    again = [sample(x, p, s) for s in range(50)]
    assert first == again
    assert len(set(first)) > 5
    other = [sample(x, SamplingParams(temperature=0.9, seed=99), s) for s in range(50)]
    assert other != first


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    x = _logits(1)
    best3 = set(np.argsort(-x)[:3].tolist())
    picks = {sample(x, SamplingParams(temperature=2.0, top_k=3, seed=5), s) for s in range(200)}
    assert picks <= best3 and len(picks) > 1
    picks = {sample(x, SamplingParams(temperature=1.0, top_p=1e-6, seed=5), s) for s in range(50)}
    assert picks == {int(np.argmax(x))}


def test_min_p_drops_unlikely_tokens() -> None:
    x = np.array([5.0, 4.9, 0.0, -3.0], dtype=np.float32)
    picks = {sample(x, SamplingParams(temperature=1.0, min_p=0.5, seed=2), s) for s in range(200)}
    assert picks == {0, 1}


def test_logprobs_are_normalised() -> None:
    x = _logits(2, 50)
    lp = logprobs_of(x, 7, top_n=5)
    total = sum(np.exp(logprobs_of(x, i, 0).logprob) for i in range(50))
    assert abs(total - 1.0) < 1e-6
    assert [t for t, _ in lp.top] == np.argsort(-x)[:5].tolist()
    assert lp.top[0][1] >= lp.top[-1][1]


def test_a_tiny_temperature_samples_the_best_token_without_nan() -> None:
    logits = np.array([0.5, 3.0, -2.0, 2.999], dtype=np.float32)
    for t in (1.1125369292536007e-308, 1e-30, 1e-6):
        assert sample(logits, SamplingParams(temperature=t, seed=3), step=0) == 1


def test_penalties_and_bias_follow_the_generated_tokens_only() -> None:
    logits = np.zeros(6, dtype=np.float32)
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"4": 3.0, "5": -100.0}
    )
    out = params.adjusted(logits, token_counts([1, 1, 2]))
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 3.0, -100.0]
    assert logits.tolist() == [0.0] * 6  # the engine's logits are left alone
    assert params.adjusted(logits, token_counts([2, 1, 1])).tolist() == out.tolist()
    plain = SamplingParams()
    assert plain.adjusted(logits, token_counts([1, 2])) is logits


# -- the distribution each mode draws from, against a plain sorting reference --


def _reference_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """What the sampler must draw from, computed the obvious way: scale, sort
    the whole vocabulary, cut (top_k, then top_p, then min_p), renormalise."""
    s = (x.astype(np.float64) - x.max()) / p.temperature
    order = np.argsort(-s, kind="stable")
    if 0 < p.top_k < len(order):
        order = order[: p.top_k]
    probs = np.exp(s[order])
    probs /= probs.sum()
    keep = len(order)
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
    if p.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
    out = np.zeros(len(x))
    out[order[:keep]] = probs[:keep] / probs[:keep].sum()
    return out


MODES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_k 20": SamplingParams(temperature=1.3, top_k=20),
    "top_p 0.9": SamplingParams(top_p=0.9),
    "top_p past the first 64": SamplingParams(temperature=2.0, top_p=0.97),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "all three": SamplingParams(temperature=0.9, top_k=200, top_p=0.95, min_p=0.02),
}


def _chi_square(counts: np.ndarray, expected: np.ndarray, order: np.ndarray) -> float:
    """Pearson's statistic over 20 bins of about equal expected mass, the
    tokens taken in ``order``."""
    cumulative = np.cumsum(expected[order])
    edges = np.searchsorted(cumulative, np.linspace(0, 1, 21)[1:-1])
    observed = np.array([c.sum() for c in np.split(counts[order], edges)], dtype=np.float64)
    mass = np.array([m.sum() for m in np.split(expected[order], edges)]) * counts.sum()
    nonempty = mass > 0
    return float((((observed - mass) ** 2)[nonempty] / mass[nonempty]).sum())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vocab", [300, 2_000, 5_000])  # inside one block, whole blocks and a tail
def test_each_mode_draws_from_the_distribution_it_promises(mode: str, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal(vocab) * 2.5).astype(np.float32)
    params = replace(MODES[mode], seed=11)
    expected = _reference_probs(x, params)
    assert np.flatnonzero(expected).size > 1  # a real distribution, not one token
    counts = np.bincount([sample(x, params, s) for s in range(12_000)], minlength=vocab)
    # The support is exactly the reference's: no token outside it is ever drawn...
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected))
    # ...and the frequencies follow it, in vocabulary order (where the blocks
    # are) and from the best token down (the shape). 19 degrees of freedom:
    # above 60 happens by chance about once in a million.
    assert _chi_square(counts, expected, np.arange(vocab)) < 60
    assert _chi_square(counts, expected, np.argsort(-expected, kind="stable")) < 60


def test_a_masked_token_is_never_drawn_and_the_edges_of_blocks_hold() -> None:
    # Weight only at the first and last token of a vocabulary of whole blocks
    # plus a tail: the block search must land on them and nothing else.
    x = np.full(1_500, -np.inf, dtype=np.float32)
    x[[0, 511, 512, 1_499]] = 0.0
    picks = {sample(x, SamplingParams(seed=3), s) for s in range(400)}
    assert picks == {0, 511, 512, 1_499}


def test_top_p_keeps_the_fewest_best_tokens_that_reach_it() -> None:
    x = np.log(np.array([0.05, 0.5, 0.3, 0.15], dtype=np.float32))
    picks = {sample(x, SamplingParams(top_p=0.8, seed=1), s) for s in range(300)}
    assert picks == {1, 2}  # 0.5 + 0.3 reaches 0.8
    picks = {sample(x, SamplingParams(top_p=0.81, seed=1), s) for s in range(300)}
    assert picks == {1, 2, 3}


def test_sampling_a_large_vocabulary_needs_no_sort_of_it() -> None:
    """The cost is O(vocabulary): ``np.sort``/``np.argsort`` only ever see the
    few candidates (top_p's nucleus), never the 262,144 tokens."""
    x = np.random.default_rng(0).standard_normal(262_144).astype(np.float32)
    seen: list[int] = []
    real_sort, real_argsort = np.sort, np.argsort

    def sort(a: np.ndarray, *args: Any, **kw: Any) -> np.ndarray:
        seen.append(np.asarray(a).size)
        return real_sort(a, *args, **kw)

    def argsort(a: np.ndarray, *args: Any, **kw: Any) -> np.ndarray:
        seen.append(np.asarray(a).size)
        return real_argsort(a, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "sort", sort)
        mp.setattr(np, "argsort", argsort)
        for params in MODES.values():
            sample(x, params, 0)
    assert seen and max(seen) < 262_144 // 8


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), *MODES.values()])
def test_logits_with_a_nan_or_nothing_finite_are_an_error_not_a_token(
    params: SamplingParams,
) -> None:
    x = _logits(3, 2_000)
    x[17] = np.nan
    with pytest.raises(ValueError, match="NaN or no finite value"):
        sample(x, params, 0)
    with pytest.raises(ValueError, match="NaN or no finite value"):
        sample(np.full(2_000, -np.inf, dtype=np.float32), params, 0)
