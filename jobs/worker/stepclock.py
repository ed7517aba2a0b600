"""Where a worker's stepping time goes: the engine, sampling, Redis, the rest.

One worker per process: the process's :data:`CLOCK` gathers the seconds of
every part as they pass (perf_counter differences, no locks: one thread
steps), and the worker adds them to the fleet's counters with each heartbeat
(``parkq_step_seconds_total{part}`` on /metrics), and the prompt-chunk calls
it counts (``parkq_prefill_calls_total``, ``parkq_prefill_chunks_total``).
``other`` is what the worker loop spent while it had work beyond the three
measured parts: scheduling, text decoding, SSE payloads, Python.
"""

from __future__ import annotations

__all__ = ["CLOCK", "COUNTS", "PARTS", "StepClock"]

#: The parts, in the order /metrics and the benchmarks list them.
PARTS = ("engine", "sampling", "redis", "other")


#: What the clock counts beside the seconds: prompt-chunk calls of the engine
#: and the chunks they took (several per call where prompts are batched).
COUNTS = ("prefill_calls", "prefill_chunks")


class StepClock:
    def __init__(self) -> None:
        self.spent = {"engine": 0.0, "sampling": 0.0, "redis": 0.0}
        #: The worker loop's time while it had work (every part included).
        self.busy = 0.0
        self.counted = dict.fromkeys(COUNTS, 0)

    def add(self, part: str, seconds: float) -> None:
        self.spent[part] += seconds

    def count(self, what: str, n: int = 1) -> None:
        self.counted[what] += n

    def take_counts(self) -> dict[str, int]:
        """The counts since the last take, and start over."""
        out, self.counted = self.counted, dict.fromkeys(COUNTS, 0)
        return out

    def take(self) -> dict[str, float]:
        """The seconds of each part since the last take (``other``: the rest of
        the busy time), and start over."""
        out = dict(self.spent)
        out["other"] = max(0.0, self.busy - sum(self.spent.values()))
        self.spent = dict.fromkeys(self.spent, 0.0)
        self.busy = 0.0
        return out


#: This process's clock.
CLOCK = StepClock()
