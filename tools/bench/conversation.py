"""A chat's next turn with and without the conversation (prompt prefix) cache.

    python -m tools.bench.conversation [--model PATH] [--words 700] [--samples 5]

For each sample a new conversation of about 1,000 tokens is sent as turn one;
then its follow-up turn (turn one, the answer, a new question) is timed to its
first token. The same follow-ups are timed on a server with the cache off.
Greedy, then with the openai client's default sampling.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, model_and_chat_format, write_results
from tools.bench.workload import Request, stream
from tools.launcher import Stack

WORDS = ["river", "mountain", "city", "library", "engine", "market", "garden", "harbor"]


def _conversation(i: int, words: int) -> list[dict[str, str]]:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "user", "content": f"Read this report:\n{text}\nSummarize it."}]


def _chat(base: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> tuple[float, str]:
    body = {"messages": messages, "max_tokens": 24, **sampling}
    req = Request("chat", time.monotonic())
    stream(f"{base}/v1/chat/completions", body, req)
    return (req.first or time.monotonic()) - req.sent, req.text


def follow_ups(
    model: str, chat_format: str | None, cache: bool, n: int, words: int, sampling: dict[str, Any]
) -> list[float]:
    settings = load_settings(
        model=model,
        port=0,
        chat_format=chat_format,
        log_level="WARNING",
        prefix_cache_bytes=None if cache else 0,
    )
    ttfts = []
    with Stack(settings) as stack:
        _chat(stack.base_url, [{"role": "user", "content": "warm up"}], sampling)
        for i in range(n):
            turn1 = _conversation(i, words)
            _, answer = _chat(stack.base_url, turn1, sampling)
            turn2 = [*turn1, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And what should we do next?"}]  # fmt: skip
            ttfts.append(_chat(stack.base_url, turn2, sampling)[0])
    return ttfts


def main() -> None:
    ap = command_line(__doc__, "conversation")
    ap.add_argument("--words", type=int, default=700, help="words of the report (~1,000 tokens)")
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    model, chat_format = model_and_chat_format(args.model)
    result: dict[str, Any] = {"model": Path(model).name}
    for arm, fields in ((arm, SAMPLING[arm]["parkq"]) for arm in SAMPLING):
        with_cache = follow_ups(model, chat_format, True, args.samples, args.words, fields)
        without = follow_ups(model, chat_format, False, args.samples, args.words, fields)
        p50_with, p50_without = statistics.median(with_cache), statistics.median(without)
        result[arm] = {
            "follow_up_ttft_ms_with_cache": [t * 1000 for t in with_cache],
            "follow_up_ttft_ms_without_cache": [t * 1000 for t in without],
            "ratio_p50": p50_with / p50_without,
        }
        print(f"model {result['model']}, {arm}: follow-up turn of a ~1,000-token conversation")
        print(
            f"  TTFT p50 with the cache {p50_with * 1000:.0f} ms, "
            f"without {p50_without * 1000:.0f} ms (ratio {p50_with / p50_without:.2f})"
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
