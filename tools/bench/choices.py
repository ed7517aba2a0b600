"""Several choices of one prompt (``n``) against as many single requests.

    python -m tools.bench.choices [--model PATH] [--n 4] [--lines 40] [--tokens 16]

Starts `parkq up` (embedded Redis, web, one worker; prefix cache off, so only
the sharing between choices can spare a prefill) with one and with ``--n``
sequences. Times ``--n`` single requests one after another, then one request
with ``n`` choices, and reads how many prompt tokens the choices took from a
sibling (``parkq_prompt_tokens_shared_total``). Greedy, and with what the
openai client sends when told nothing (no temperature: 1, top_p 1).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import requests

from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, model_and_chat_format, write_results
from tools.client import read_counter
from tools.launcher import Stack


def _timed(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    resp = requests.post(url, json=body, timeout=3600)
    resp.raise_for_status()
    answer: dict[str, Any] = resp.json()
    return time.monotonic() - t0, answer


def choices(
    model: str, chat_format: str | None, n: int, seqs: int, body: dict[str, Any]
) -> dict[str, Any]:
    settings = load_settings(model=model, port=0, chat_format=chat_format, log_level="WARNING",
                             max_seqs=seqs, prefix_cache_bytes=0)  # fmt: skip
    with Stack(settings) as stack:
        url = f"{stack.base_url}/v1/completions"
        _timed(url, {"prompt": "warm up", "max_tokens": 2})
        singles = sum(_timed(url, {**body, "seed": 10 + i})[0] for i in range(n))
        before = read_counter(stack.base_url, {}, "parkq_prompt_tokens_shared_total")
        together, answer = _timed(url, {**body, "seed": 10, "n": n})
        shared = read_counter(stack.base_url, {}, "parkq_prompt_tokens_shared_total") - before
    return {
        "sampling": "greedy" if body.get("temperature") == 0 else "default",
        "sequences": seqs,
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "singles_s": round(singles, 2),
        "choices_s": round(together, 2),
        "prompt_tokens_shared": int(shared),
    }


def main() -> None:
    ap = command_line(__doc__, "choices")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lines", type=int, default=40, help="prompt length, in lines of ~15 tokens")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per choice")
    args = ap.parse_args()
    model, chat_format = model_and_chat_format(args.model)
    prompt = " ".join(
        f"Line {i}: the park opens at dawn and closes at dusk." for i in range(args.lines)
    )
    body = {"prompt": prompt, "max_tokens": args.tokens, "ignore_eos": True}
    runs = [
        choices(model, chat_format, args.n, seqs, {**body, **arm["parkq"]})
        for arm in SAMPLING.values()
        for seqs in (1, args.n)
    ]
    print(f"model {Path(model).name}, n={args.n}, {args.tokens} tokens a choice")
    for r in runs:
        print(
            f"  {r['sampling']}, {r['sequences']} sequence(s): "
            f"{args.n} single requests {r['singles_s']} s, "
            f"n={args.n} {r['choices_s']} s; {r['prompt_tokens_shared']} of "
            f"{(args.n - 1) * r['prompt_tokens']} sibling prompt tokens shared"
        )
    write_results(args.out, {"model": Path(model).name, "n": args.n, "runs": runs})


if __name__ == "__main__":
    main()
