"""Token sampling in NumPy, resumable by construction.

The random draw of step ``n`` comes from a generator seeded with
``(seed, n)``, so the sampler has no hidden state: a generation parked after
step ``n`` and resumed anywhere draws exactly what it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["SamplingParams", "TokenLogprob", "logprobs_of", "sample"]


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

    def adjusted(self, logits: np.ndarray, generated: list[int]) -> np.ndarray:
        """``logits`` after the bias and the penalties (a copy; the input if none
        applies). They depend only on the tokens generated so far, so a resumed
        generation adjusts exactly as the uninterrupted one did."""
        if not (self.logit_bias or self.presence_penalty or self.frequency_penalty):
            return logits
        out = logits.astype(np.float32, copy=True)
        for token, bias in self.logit_bias.items():
            out[int(token)] += bias
        if generated and (self.presence_penalty or self.frequency_penalty):
            tokens, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            out[tokens] -= self.presence_penalty + self.frequency_penalty * counts
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    """Pick the next token from raw ``logits`` at generation step ``step``."""
    if params.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf
        scaled = (x - x.max()) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if 0 < params.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    values = scaled[candidates]
    order = np.argsort(-values, kind="stable")
    candidates, values = candidates[order], values[order]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    keep = probs.shape[0]
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    candidates, probs = candidates[:keep], probs[:keep]
    probs = probs / probs.sum()
    rng = np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, step])
    return int(candidates[rng.choice(probs.shape[0], p=probs)])


def logprobs_of(logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """The model's log-probability of ``token`` and of its ``top_n`` best alternatives."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        idx = np.argpartition(-x, top_n - 1)[:top_n]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = tuple((int(i), float(x[i]) - lse) for i in idx)
    return TokenLogprob(token, float(x[token]) - lse, top)
