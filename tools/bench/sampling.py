"""The sampler alone, per token, on a real model's logits: each sampling mode
against a plain implementation that sorts the whole vocabulary.

    python -m tools.bench.sampling [--model PATH] [--steps 200] [--out FILE.json]

Generates ``--steps`` tokens greedily from a prompt on the model (default: the
demo model, 262,144 tokens of vocabulary) and keeps every step's logits; then
times, per mode, ``jobs.engine.sampling.sample`` over all of them (each step a fresh
array, as the engine hands them over), beside the reference that sorts the
vocabulary (what the sampler did before: float64, a stable argsort, then the
cuts). Prints milliseconds per token and writes JSON.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jobs.engine.llama import LlamaEngine
from jobs.engine.sampling import SamplingParams, sample
from tools.bench import command_line, model_and_chat_format, write_results

PROMPT = "The history of the printing press begins in the fifteenth century, when"

MODES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "openai default (temperature 1, top_p 1)": SamplingParams(),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_p 0.9": SamplingParams(top_p=0.9),
    "top_p 0.99": SamplingParams(top_p=0.99),
    "top_k 40": SamplingParams(top_k=40),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "llama.cpp's defaults (top_k 40, top_p 0.95, min_p 0.05, temperature 0.8)": SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05
    ),
}


def sorting_reference(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    """The sampler as it was: float64, the whole vocabulary sorted every token."""
    if params.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
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
    probs = probs[:keep] / probs[:keep].sum()
    rng = np.random.default_rng([params.seed, step])
    return int(candidates[:keep][rng.choice(keep, p=probs)])


def _logits(model: str, steps: int) -> list[np.ndarray]:
    engine = LlamaEngine(model, n_ctx=steps + 64, n_batch=256)
    ids = engine.tokenize(PROMPT)
    logits = engine.eval(ids, 0)
    out = []
    for pos in range(len(ids), len(ids) + steps):
        out.append(logits)
        logits = engine.eval([int(np.argmax(logits))], pos)
    engine.close()
    return out


def _ms_per_token(fn: Any, steps: list[np.ndarray], params: SamplingParams) -> float:
    fn(steps[0].copy(), params, 0)  # warm
    fresh = [x.copy() for x in steps]
    t0 = time.perf_counter()
    for i, x in enumerate(fresh):
        fn(x, params, i)
    return (time.perf_counter() - t0) * 1000 / len(fresh)


def main() -> None:
    ap = command_line(__doc__, "sampling")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    model, _ = model_and_chat_format(args.model)
    steps = _logits(model, args.steps)
    rows = []
    for name, params in MODES.items():
        ours = _ms_per_token(sample, steps, params)
        ref = _ms_per_token(sorting_reference, steps, params)
        rows.append({"mode": name, "ms_per_token": round(ours, 3),
                     "sorting_reference_ms_per_token": round(ref, 3)})  # fmt: skip
        print(f"{name:<75} {ours:8.3f} ms   (sorting the vocabulary: {ref:7.2f} ms)", flush=True)
    write_results(args.out, {"model": model, "vocabulary": int(steps[0].shape[0]),
                             "steps": args.steps, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
