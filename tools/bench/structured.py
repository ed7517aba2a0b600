"""Structured outputs: what the grammar costs per token, and on resume.

    python -m tools.bench.structured [--model PATH] [--tokens 200] [--threads N]

On the model (default: the demo model), one completion constrained by a JSON
schema and the same number of tokens unconstrained (``ignore_eos``), greedy and
with the openai client's default sampling, decode steps timed alone; prints
tokens/s of each, their ratio, the mask (and sampling) time per token, the
time to build the grammar's view of the vocabulary (once per worker) and to
rebuild a matcher from the tokens generated so far (what a resume does);
writes them as JSON.
"""

from __future__ import annotations

import time
from typing import Any

from jobs.engine.constraints import grammar_for_json_schema
from jobs.engine.llama import LlamaEngine
from jobs.engine.sampling import SamplingParams, sample
from tools.bench import command_line, model_and_chat_format, write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "points": {"type": "array", "items": {"type": "string", "minLength": 40,
                                               "maxLength": 80}, "minItems": 8, "maxItems": 8},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "points", "score"],
    "additionalProperties": False,
}  # fmt: skip


def main() -> None:
    ap = command_line(__doc__, "structured")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    model, _ = model_and_chat_format(args.model)
    engine = LlamaEngine(model, n_ctx=2048, n_batch=256, n_threads=args.threads,
                         extra_buffers=False)  # fmt: skip
    prompt = engine.tokenize("A summary of the history of printing, as JSON:")
    grammar = grammar_for_json_schema(SCHEMA)
    t0 = time.perf_counter()
    constraint = engine.constraint(grammar)
    vocab_s = time.perf_counter() - t0

    def run(constrained: bool, params: SamplingParams) -> tuple[list[int], float, float]:
        engine.clear(0)
        c = engine.constraint(grammar) if constrained else None
        logits = engine.eval(prompt, 0)
        out: list[int] = []
        decode = mask = 0.0
        while len(out) < args.tokens:
            t = time.perf_counter()
            masked = c.masked(logits) if c is not None else logits
            token = sample(masked, params, len(out))
            if c is not None:
                c.consume(token)
            mask += time.perf_counter() - t
            out.append(token)
            if c is not None and c.complete:
                break
            t = time.perf_counter()
            logits = engine.eval([token], len(prompt) + len(out) - 1)
            decode += time.perf_counter() - t
        return out, decode, mask

    results: dict[str, Any] = {"model": model, "grammar_vocabulary_s": round(vocab_s, 2)}
    # Greedy, and what the openai client sends unasked (temperature 1, top_p 1):
    # "mask" is then the mask and the sampling, per token.
    for arm, params in (("greedy", SamplingParams(temperature=0.0)), ("default", SamplingParams())):
        run(False, params)  # warm
        free, free_decode, free_pick = run(False, params)
        shaped, shaped_decode, mask = run(True, params)
        n = len(shaped)
        free_rate = len(free) / (free_decode + free_pick)
        shaped_rate = n / (shaped_decode + mask)
        t0 = time.perf_counter()
        rebuilt = engine.constraint(grammar)
        rebuilt.feed(shaped)
        rebuild_ms = (time.perf_counter() - t0) * 1000
        results[arm] = {
            "constrained_tokens": n,
            "unconstrained_tok_s": round(free_rate, 1),
            "constrained_tok_s": round(shaped_rate, 1),
            "ratio": round(shaped_rate / free_rate, 3),
            "mask_and_sampling_ms_per_token": round(1000 * mask / n, 3),
            "rebuild_ms": round(rebuild_ms, 2),
            "text": b"".join(engine.token_bytes(t) for t in shaped).decode(errors="replace"),
        }
    del constraint
    for k, v in results.items():
        print(f"{k}: {v}")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
