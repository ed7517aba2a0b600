"""`parkq worker` with faults injected by the tests, never by production settings.

Run as ``python -m tests.faultworker --name NAME`` (the arguments of
``parkq worker``). Each fault is off unless its environment variable is set:

- ``PARKQ_TEST_PREFILL_DELAY_SECONDS``: every multi-token engine call (a prompt
  chunk) first sleeps this long: a slow model's prefill or re-prefill.
- ``PARKQ_TEST_DECODE_DELAY_SECONDS``: every decode step (one token, or one
  token of each of several sequences) first sleeps this long: a slow model's
  decode (and replay), whatever this machine's speed.
- ``PARKQ_TEST_DECODE_DELAY_PER_SEQ_SECONDS``: a decode step of several
  sequences also sleeps this long per sequence: batching that costs time.
- ``PARKQ_TEST_DIE_AFTER_TOKENS``: the process SIGKILLs itself right after a step
  write has recorded this many generated tokens of a job.
- ``PARKQ_TEST_STOP_AFTER_TOKENS``: the process asks itself to stop (SIGTERM: it
  parks its job at the next step and exits) once a step write has recorded this
  many generated tokens.
- ``PARKQ_TEST_PARK_DELAY_SECONDS``: a park pauses between saving the job's KV and
  recording the park (a window to kill the worker in the middle of a checkpoint).
- ``PARKQ_TEST_CLAIM_DELAY_SECONDS``: after claiming a job the worker pauses before
  its first read of the job (a window to restart Redis in).
- ``PARKQ_TEST_JOB_ERROR_AFTER_TOKENS``: the first job of this process that
  reaches this many generated tokens raises a RuntimeError inside its
  generation (a bug in one job's path): once per process.
- ``PARKQ_TEST_WORKER_ERROR_AFTER_TOKENS``: the worker's loop raises a
  RuntimeError right after a step write recorded this many tokens (a bug
  outside any one job): the process exits, its cleanup reaching Redis.
- ``PARKQ_TEST_LOGITS_DIFFER_FROM``: from this position on, every logit row
  this process computes favours another token (as another device or kernel
  path would round otherwise): its replay of a job another worker began
  computes other tokens from there.
- ``PARKQ_TEST_BATCH_VARIANT_FROM`` (``SIZE:POSITION``): a decode call of SIZE or
  more sequences gives slightly other logits at POSITION and later, as a kernel
  that changes with the batch width past some length would (CUDA's at 512 cells).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jobs.engine.llama import LlamaEngine
from jobs.store.scheduling import Store


def _seconds(name: str) -> float:
    return float(os.environ.get(name, "0") or 0)


def _install() -> None:
    prefill = _seconds("PARKQ_TEST_PREFILL_DELAY_SECONDS")
    decode = _seconds("PARKQ_TEST_DECODE_DELAY_SECONDS")
    per_seq = _seconds("PARKQ_TEST_DECODE_DELAY_PER_SEQ_SECONDS")
    die_after = int(os.environ.get("PARKQ_TEST_DIE_AFTER_TOKENS", "0") or 0)
    stop_after = int(os.environ.get("PARKQ_TEST_STOP_AFTER_TOKENS", "0") or 0)
    park_delay = _seconds("PARKQ_TEST_PARK_DELAY_SECONDS")
    claim_delay = _seconds("PARKQ_TEST_CLAIM_DELAY_SECONDS")
    variant = os.environ.get("PARKQ_TEST_BATCH_VARIANT_FROM", "")
    differ = int(os.environ.get("PARKQ_TEST_LOGITS_DIFFER_FROM", "0") or 0)
    job_error = int(os.environ.get("PARKQ_TEST_JOB_ERROR_AFTER_TOKENS", "0") or 0)
    worker_error = int(os.environ.get("PARKQ_TEST_WORKER_ERROR_AFTER_TOKENS", "0") or 0)

    if prefill or decode or per_seq:
        original_eval = LlamaEngine.eval

        def slow_eval(
            self: LlamaEngine, tokens: Sequence[int], pos: int, seq: int = 0
        ) -> np.ndarray:
            time.sleep(prefill if len(tokens) > 1 else decode + per_seq)
            return original_eval(self, tokens, pos, seq)

        LlamaEngine.eval = slow_eval  # type: ignore[method-assign]
        original_decode = LlamaEngine._decode

        def slow_decode(
            self: LlamaEngine, steps: Sequence[tuple[int, int, int]]
        ) -> list[np.ndarray]:
            time.sleep(decode + per_seq * len(steps))  # one step of several sequences
            return original_decode(self, steps)

        LlamaEngine._decode = slow_decode  # type: ignore[method-assign]

    if variant:
        plant_batch_variance(*(int(part) for part in variant.split(":")))
    if differ:
        original_one = LlamaEngine.eval

        def other_eval(
            self: LlamaEngine, tokens: Sequence[int], pos: int, seq: int = 0
        ) -> np.ndarray:
            logits = original_one(self, tokens, pos, seq)
            if pos + len(tokens) - 1 >= differ:
                logits[int(np.argmin(logits))] += 1e4  # another token wins
            return logits

        LlamaEngine.eval = other_eval  # type: ignore[method-assign]
    if job_error:
        from jobs.worker.execution import Executions

        original_emit = Executions._emit
        raised: list[bool] = []

        def faulty_emit(self: Executions, job: Any, writer: Any, payloads: list[str]) -> Any:
            if not raised and len(job.gen.generated) >= job_error:
                raised.append(True)
                raise RuntimeError(f"planted: job {job.job_id} fails at a token")
            return original_emit(self, job, writer, payloads)

        Executions._emit = faulty_emit  # type: ignore[method-assign]

    def after(method: str, hook: Callable[[Any, tuple[Any, ...], Any], None]) -> None:
        original = getattr(Store, method)

        @functools.wraps(original)
        def wrapped(self: Store, *args: Any) -> Any:
            result = original(self, *args)
            hook(self, args, result)
            return result

        setattr(Store, method, wrapped)

    def most_tokens(args: tuple[Any, ...]) -> int:
        """The most tokens a step write of ``Store.steps(calls)`` recorded."""
        return max((call.tokens for call in args[0]), default=0)

    if die_after:

        def die(store: Store, args: tuple[Any, ...], result: Any) -> None:
            if most_tokens(args) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)

        after("steps", die)
    if stop_after:
        asked: list[bool] = []

        def stop(store: Store, args: tuple[Any, ...], result: Any) -> None:
            if most_tokens(args) >= stop_after and not asked:
                asked.append(True)
                os.kill(os.getpid(), signal.SIGTERM)

        after("steps", stop)
    if worker_error:

        def fail(store: Store, args: tuple[Any, ...], result: Any) -> None:
            if most_tokens(args) >= worker_error:
                raise RuntimeError("planted: the worker's loop fails")

        after("steps", fail)
    if claim_delay:
        after("claim", lambda store, args, claim: time.sleep(claim_delay) if claim else None)
    if park_delay:
        original_park = Store.park

        def slow_park(self: Store, *args: Any) -> str:
            time.sleep(park_delay)  # the KV is saved; the park is not recorded yet
            return original_park(self, *args)

        Store.park = slow_park  # type: ignore[method-assign, assignment]


Decode = Callable[[Sequence[tuple[int, int, int]]], list[np.ndarray]]


def batch_variant(decode: Decode, size: int, position: int) -> Decode:
    """``decode`` (one engine's ``_decode``), except that calls of ``size`` or more
    sequences change each logit row a little from ``position`` on."""

    def variant(steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        out = decode(steps)
        if len(steps) >= size:
            for (_, _, pos), logits in zip(steps, out, strict=True):
                if pos >= position:
                    logits[0] += 1e-3
        return out

    return variant


def plant_batch_variance(size: int, position: int) -> None:
    """Every engine's decode calls vary so (PARKQ_TEST_BATCH_VARIANT_FROM)."""
    original = LlamaEngine._decode

    def variant(self: LlamaEngine, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        return batch_variant(functools.partial(original, self), size, position)(steps)

    LlamaEngine._decode = variant  # type: ignore[method-assign]


if __name__ == "__main__":
    _install()
    from tools.cli import main

    sys.argv = ["parkq", "worker", *sys.argv[1:]]
    main()
