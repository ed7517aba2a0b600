import numpy as np

from jobs.sampling import SamplingParams, logprobs_of, sample


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
    out = params.adjusted(logits, [1, 1, 2])
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 3.0, -100.0]
    assert logits.tolist() == [0.0] * 6  # the engine's logits are left alone
    assert params.adjusted(logits, [2, 1, 1]).tolist() == out.tolist()  # counts, not order
    plain = SamplingParams()
    assert plain.adjusted(logits, [1, 2]) is logits
