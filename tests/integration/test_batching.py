"""Continuous batching: several sequences per engine, each still token-exact.

The engine's own promise first (real llama.cpp, every weight type the tests
have): a sequence decoded beside others gives the logits it gets alone, bit for
bit; one engine call for all where the kernels allow it (the engine probes
that), one call each where they do not. Then real workers with
``PARKQ_MAX_SEQS`` > 1: concurrent jobs run side by side and each streams what a
one-sequence worker streams; a full engine parks its lowest job for a better
one; a SIGKILLed worker's sequences all resume elsewhere; a worker restarted
under its old name takes its sequences back.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from jobs.engine.kernels import invariant_batch_size
from jobs.engine.llama import PROBE_STRIDE, LlamaEngine, NotRepeatable, device_key
from jobs.engine.testmodel import write_test_model
from tests.faultworker import batch_variant
from tests.integration.helpers import (
    completion_text,
    job,
    logprob_tokens,
    read_events,
    submit_stream,
    wait_until,
)
from tests.integration.test_parking import SAMPLING, _long, _metrics
from tests.integration.test_workers import Cluster, running_cluster

N_BATCH = 16


@pytest.fixture(scope="module", params=["f32", "q8_0", "q4_0"])
def any_model(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"batch-{request.param}")
    return write_test_model(root / f"tiny-{request.param}.gguf", seed=0, quant=request.param)


def _engine(model: Path, n_seq_max: int) -> LlamaEngine:
    return LlamaEngine(
        str(model), n_ctx=512, n_batch=N_BATCH, n_threads=1, n_seq_max=n_seq_max,
        extra_buffers=False,
    )  # fmt: skip


def _prefill(engine: LlamaEngine, ids: list[int], seq: int) -> np.ndarray:
    logits = None
    for start in range(0, len(ids), N_BATCH):
        logits = engine.eval(ids[start : start + N_BATCH], start, seq)
    assert logits is not None
    return logits


PROMPTS = ["The first one", "A second, longer prompt that spans several chunks " * 2,
           "Third", "The fourth arrives while the others decode"]  # fmt: skip
STEPS = 40


def test_a_sequence_decoded_beside_others_gets_the_logits_it_gets_alone(any_model: Path) -> None:
    alone = []
    for prompt in PROMPTS:
        engine = _engine(any_model, 1)
        ids = engine.tokenize(prompt)
        out = [_prefill(engine, ids, 0)]
        for i in range(STEPS):
            out.append(engine.eval([int(np.argmax(out[-1]))], len(ids) + i, 0))
        alone.append(out)
        engine.close()

    engine = _engine(any_model, 4)
    print(f"\n{any_model.name}: one decode call takes up to {engine.probe_batching()} sequences")
    got: dict[int, list[np.ndarray]] = {}
    pos: dict[int, int] = {}

    def admit(seq: int) -> None:
        ids = engine.tokenize(PROMPTS[seq])
        got[seq], pos[seq] = [_prefill(engine, ids, seq)], len(ids)

    for seq in (0, 1, 2):
        admit(seq)
    for step in range(STEPS + 6):
        if step == 6:
            admit(3)  # joins later: its prefill runs in calls of its own, between steps
        if step == 20:
            engine.clear(1)  # leaves early: its cells are freed
            del pos[1]
        calls = [(s, int(np.argmax(got[s][-1])), pos[s]) for s in pos if len(got[s]) <= STEPS]
        if step % 2:
            calls.reverse()  # a worker lists its sequences in any order: each gets its own
        for (s, _, _), logits in zip(calls, engine.decode(calls), strict=True):
            got[s].append(logits)
            pos[s] += 1
    engine.close()
    for seq, steps in got.items():
        assert len(steps) == (21 if seq == 1 else STEPS + 1)
        for i, (a, b) in enumerate(zip(alone[seq], steps, strict=False)):
            assert np.array_equal(a, b), f"sequence {seq} differs at step {i}"


#: Past 512 KV cells, where llama.cpp's CPU flash attention would split a lone
#: sequence's cells into one chunk per thread (and so round otherwise than in a
#: batch, and otherwise for each thread count).
LONG_CONTEXT = 700


def _long_run(engine: LlamaEngine, ids: list[int], neighbour: list[int] | None) -> list[np.ndarray]:
    """Prefill ``ids`` in sequence 0, then decode a few greedy steps, alone or in one
    call with a ``neighbour`` sequence (1) decoding beside it."""
    engine.clear(-1)
    out = [_prefill(engine, ids, 0)]
    other = [_prefill(engine, neighbour, 1)] if neighbour else []
    for i in range(6):
        calls = [(0, int(np.argmax(out[-1])), len(ids) + i)]
        if neighbour:
            calls.append((1, int(np.argmax(other[-1])), len(neighbour) + i))
        if neighbour:
            logits = engine._decode(calls)
        else:
            logits = [engine.eval([calls[0][1]], calls[0][2], 0)]
        out.append(logits[0])
        other.extend(logits[1:])
    return out


def test_a_long_sequence_gets_the_same_logits_alone_beside_others_and_on_any_thread_count(
    q8_model: Path,
) -> None:
    rng = np.random.default_rng(5)

    def engine(threads: int, seqs: int) -> LlamaEngine:
        return LlamaEngine(str(q8_model), n_ctx=1024, n_batch=N_BATCH, n_threads=threads,
                           n_seq_max=seqs, extra_buffers=False)  # fmt: skip

    two = engine(2, 2)
    ids = [int(x) for x in rng.integers(3, two.n_vocab, LONG_CONTEXT)]
    short = [int(x) for x in rng.integers(3, two.n_vocab, 20)]
    alone = _long_run(two, ids, None)
    beside_short = _long_run(two, ids, short)
    beside_long = _long_run(two, ids, ids[::-1])
    two.close()
    one = engine(1, 1)
    one_thread = _long_run(one, ids, None)
    one.close()
    runs = {"beside a short sequence": beside_short, "beside a long sequence": beside_long,
            "on one thread": one_thread}  # fmt: skip
    for name, run in runs.items():
        for i, (a, b) in enumerate(zip(alone, run, strict=True)):
            assert np.array_equal(a, b), f"{name}: step {i} differs by {np.max(np.abs(a - b))}"


def test_the_batching_verdict_is_checked_once_per_engine_shape_and_cached(
    q8_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(q8_model, 4)
    first = invariant_batch_size(engine, 4, str(tmp_path))
    assert first[1].startswith("checked: positions checked up to") and 1 <= first[0] <= 4
    again = invariant_batch_size(engine, 4, str(tmp_path))
    assert again[0] == first[0] and again[1].startswith("cached: positions checked up to")
    assert invariant_batch_size(engine, 3, str(tmp_path))[1].startswith("checked")  # another shape
    # A variable that changes llama.cpp's kernels is another shape too.
    monkeypatch.setenv("GGML_SCHED_MAX_COPIES", "1")
    assert invariant_batch_size(engine, 4, str(tmp_path))[1].startswith("checked")
    engine.plan_batching(first[0])
    assert engine.max_batch == first[0]
    engine.close()


def _probe_engine(model: Path, n_ctx: int) -> LlamaEngine:
    return LlamaEngine(str(model), n_ctx=n_ctx, n_batch=64, n_threads=1, n_seq_max=4,
                       extra_buffers=False)  # fmt: skip


@pytest.mark.parametrize("size, position", [(3, 700), (2, 1010), (4, 256)])
def test_the_probe_refuses_a_size_that_differs_anywhere_in_the_context(
    q8_model: Path, size: int, position: int
) -> None:
    """A kernel that changes with the batch width only past some length (CUDA's
    do at 512 cells): the probe follows the context to its end and refuses that
    width and every wider one, and says where it differed. (Measured against the
    backend's own verdict: where its kernels already differ, as CUDA's do, the
    plant cannot widen anything.)"""
    engine = _probe_engine(q8_model, 1024)
    own = engine.probe_invariance(4, every_size=True)
    engine._decode = batch_variant(engine._decode, size, position)  # type: ignore[method-assign, assignment]
    verdict = engine.probe_invariance(4, every_size=True)
    assert verdict.size == min(own.size, size - 1)
    assert verdict.complete and verdict.horizon >= 1010
    if size not in own.failed:  # the backend agrees at this width (every CPU seen so far)
        assert position <= verdict.failed[size].position < position + PROBE_STRIDE
        assert f"{size} per call first differed at position" in verdict.describe()
    engine.close()


def test_the_probe_certifies_the_whole_context_and_says_how_far_it_got(q8_model: Path) -> None:
    engine = _probe_engine(q8_model, 1024)
    whole = engine.probe_invariance(4)
    assert whole.complete and whole.horizon >= 1010
    assert (whole.size == 4) == (not whole.failed)  # refused only where something differed
    assert "positions checked up to 10" in whole.describe()
    # Out of time after the first checkpoint: a verdict for the positions checked,
    # which says so.
    clock = iter(range(0, 1000, 100))
    short = engine.probe_invariance(4, seconds=50, clock=lambda: float(next(clock)))
    assert short.horizon < 512 and not short.complete and "stopped at" in short.describe()
    engine.close()


def test_a_step_that_does_not_repeat_is_an_error_not_a_batch_of_one(q8_model: Path) -> None:
    engine = _probe_engine(q8_model, 1024)
    original = engine.eval
    seen: dict[int, int] = {}

    def flaky(tokens: Any, pos: int, seq: int = 0) -> np.ndarray:
        out = original(tokens, pos, seq)
        if len(tokens) == 1 and seq == 0 and pos >= 600:
            seen[pos] = seen.get(pos, 0) + 1
            out[0] += 1e-3 * seen[pos]  # each run of the same step differs
        return out

    engine.eval = flaky  # type: ignore[method-assign]
    with pytest.raises(NotRepeatable, match="position 766"):
        engine.probe_invariance(4)
    engine.close()


def _concurrent(
    c: Cluster, bodies: list[dict[str, Any]]
) -> tuple[list[str], list[list[tuple[int, str]]]]:
    """Submit every body at once; read the streams side by side."""
    results: list[list[tuple[int, str]]] = [[] for _ in bodies]
    resps = [submit_stream(c.base_url, body) for body in bodies]

    def read(i: int) -> None:
        results[i] = read_events(resps[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [r.headers["X-Job-Id"] for r in resps], results


def _bodies() -> list[dict[str, Any]]:
    """Six jobs, each sampling its own way (greedy, a temperature, the API's
    defaults with every knob; twice over)."""
    modes = list(SAMPLING.values())
    return [
        _long(**{**modes[i % len(modes)], "max_tokens": 600,
                 "prompt": f"Sequence {i} of the batch", "seed": i})
        for i in range(6)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def references(redis_server, q8_model: Path, tmp_path_factory) -> list[list[tuple[int, str]]]:
    """Each body's stream from a one-sequence worker, one job at a time."""
    root = tmp_path_factory.mktemp("batch-ref")
    with running_cluster(redis_server.url, q8_model, root, "batchref", ("one",)) as c:
        return [read_events(submit_stream(c.base_url, body)) for body in _bodies()]


@pytest.fixture
def batching(redis_server, q8_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    prefix = f"batch{time.monotonic_ns()}"
    with running_cluster(redis_server.url, q8_model, tmp_path, prefix, ()) as c:
        yield c


#: Four sequences per worker, each decode step at least 1 ms: jobs of 600
#: tokens run long enough to overlap whatever the machine's speed.
FOUR = {"PARKQ_MAX_SEQS": "4", "PARKQ_TEST_DECODE_DELAY_SECONDS": "0.001"}


@pytest.mark.timeout(300)
def test_concurrent_jobs_run_side_by_side_and_each_streams_what_it_streams_alone(
    batching: Cluster, references: list[list[tuple[int, str]]]
) -> None:
    _side_by_side_as_alone(batching, references, FOUR)
    # What the worker certified, as /v1/models tells a client.
    line = _exactness(batching)
    assert re.match(r"up to \d+ sequences per decode call, each as alone: per-op check:", line)
    assert re.search(r"KV lengths up to \d+ of 4096", line)
    if device_key(None) == "CPU":  # Q8_0 on a CPU: every width agrees (CUDA's differ)
        assert line.startswith("up to 4 sequences") and "every width up to 4 agrees" in line


def _exactness(c: Cluster) -> str:
    (model,) = requests.get(f"{c.base_url}/v1/models", timeout=30).json()["data"]
    (line,) = model["exactness"]  # one worker setup
    assert isinstance(line, str)
    return line


def _side_by_side_as_alone(
    c: Cluster, references: list[list[tuple[int, str]]], env: dict[str, str]
) -> None:
    c.start_worker("quad", env=env)
    wait_until(lambda: c.workers_alive() == 1, timeout=60)  # one process, four sequences
    ids, results = _concurrent(c, _bodies())
    for got, ref in zip(results, references, strict=True):
        assert [i for i, _ in got] == list(range(1, len(got) + 1))
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)
    # They ran together, on the four sequences of one process.
    assert {job(c.base_url, j)["worker"] for j in ids} == {"quad", "quad/1", "quad/2", "quad/3"}


@pytest.mark.timeout(300)
def test_a_width_that_differs_only_past_400_positions_is_not_used_and_streams_stay_exact(
    batching: Cluster, references: list[list[tuple[int, str]]], tmp_path: Path
) -> None:
    """Planted in the worker: three or more sequences in one call get other logits
    from position 400 on (as CUDA's kernels do from 512 cells). The worker's probe
    finds it, decodes in calls of two, and each stream is still its run alone.
    (Its own cache: the machine's holds the verdict of this build without the plant.)"""
    env = {**FOUR, "PARKQ_TEST_BATCH_VARIANT_FROM": "3:400",
           "PARKQ_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    _side_by_side_as_alone(batching, references, env)
    # The per-op check (which cannot see a plant inside the engine) passes 4; the
    # whole model refuses 3, and the worker says so.
    line = _exactness(batching)
    assert re.match(r"up to [12] sequences per decode call", line)
    if device_key(None) == "CPU":
        assert line.startswith("up to 2 sequences") and "every width up to 4" in line


def _two_running_then_a_better_one(
    c: Cluster, name: str, env: dict[str, str]
) -> tuple[list[str], list[list[tuple[int, str]]]]:
    """On a worker of two sequences, two batch jobs side by side, then an
    interactive one: their ids and their streams, read to the end."""
    c.start_worker(name, env={**FOUR, **env, "PARKQ_MAX_SEQS": "2"})
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resps = [submit_stream(c.base_url, body) for body in _bodies()[:2]]
    ids = [r.headers["X-Job-Id"] for r in resps]
    # Both past their minimum run time (100 steps of at least 1 ms; 0.05 s in the
    # tests): the victim is then the lower job. A job still inside it cannot be
    # chosen, and the higher one parked instead would rightly take its sequence
    # back from the lower one later: a second preemption, on a slow machine.
    wait_until(
        lambda: all(
            (s := job(c.base_url, j))["state"] == "running" and s["tokens"] > 100 for j in ids
        ),
        timeout=60,
    )
    assert {job(c.base_url, j)["worker"] for j in ids} == {name, f"{name}/1"}  # side by side
    short = read_events(
        submit_stream(c.base_url, {"prompt": "hi", "max_tokens": 8, "priority": "interactive"})
    )
    assert short[-1][1] == "[DONE]"
    return ids, [read_events(r) for r in resps]


@pytest.mark.timeout(300)
def test_a_full_engine_parks_its_lowest_sequence_for_a_better_job(
    batching: Cluster, references: list[list[tuple[int, str]]]
) -> None:
    c = batching
    ids, streams = _two_running_then_a_better_one(c, "pair", {})
    assert sum(job(c.base_url, j)["preemptions"] for j in ids) == 1  # one sequence made room
    for got, ref in zip(streams, references[:2], strict=True):
        assert [i for i, _ in got] == list(range(1, len(got) + 1))
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)


@pytest.mark.timeout(300)
def test_a_sigkilled_worker_s_sequences_all_resume_and_its_old_name_takes_them_back(
    batching: Cluster, references: list[list[tuple[int, str]]]
) -> None:
    c = batching
    c.start_worker("gpu0", env=FOUR)
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    bodies = _bodies()[:4]
    resps = [submit_stream(c.base_url, body) for body in bodies]
    ids = [r.headers["X-Job-Id"] for r in resps]
    wait_until(lambda: all(job(c.base_url, j)["tokens"] > 50 for j in ids), timeout=60)
    workers = {job(c.base_url, j)["worker"] for j in ids}
    assert workers == {"gpu0", "gpu0/1", "gpu0/2", "gpu0/3"}  # one job per sequence
    c.procs["gpu0"].send_signal(signal.SIGKILL)
    c.procs["gpu0"].wait()
    c.start_worker("gpu0", env=FOUR)  # restarted under its old name, at once
    streams = []
    for r in resps:
        streams.append(read_events(r))
        r.close()
    for got, ref in zip(streams, references[:4], strict=True):
        assert [i for i, _ in got] == list(range(1, len(got) + 1))
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)
    assert all(job(c.base_url, j)["state"] == "finished" for j in ids)
    assert c.procs["gpu0"].poll() is None


@pytest.mark.timeout(300)
def test_an_interactive_stream_keeps_its_pace_beside_batch_sequences(
    batching: Cluster, references: list[list[tuple[int, str]]]
) -> None:
    """Decoding costs 5 ms more per sequence in the step: a batch sequence beside
    an interactive one would make it 2x slower, so batch sequences sit out
    steps, taking turns, while it runs; every text is still the same."""
    c = batching
    c.start_worker("paced", env={"PARKQ_MAX_SEQS": "4",
                                 "PARKQ_TEST_DECODE_DELAY_PER_SEQ_SECONDS": "0.005"})  # fmt: skip
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resps = [submit_stream(c.base_url, body) for body in _bodies()[:3]]
    ids = [r.headers["X-Job-Id"] for r in resps]
    wait_until(lambda: all(job(c.base_url, j)["tokens"] > 20 for j in ids), timeout=60)
    body = {"prompt": "A person asks", "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "priority": "interactive"}  # fmt: skip
    interactive = submit_stream(c.base_url, body)
    first = read_events(interactive, limit=1)
    before = [job(c.base_url, j)["tokens"] for j in ids]
    events = first + read_events(interactive)
    after = [job(c.base_url, j)["tokens"] for j in ids]
    moved = [b - a for a, b in zip(before, after, strict=True)]
    # Without pacing each would have moved about 150 tokens.
    assert all(m <= 0.6 * 150 for m in moved), moved
    assert all(m > 0 for m in moved), moved  # taking turns, none starved
    streams = [read_events(r) for r in resps]
    for got, ref in zip(streams, references[:3], strict=True):
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)
    alone = read_events(submit_stream(c.base_url, body))
    assert completion_text(events) == completion_text(alone)


def _held_bytes(c: Cluster) -> float:
    return _metrics(c)["parkq_checkpoint_bytes{}"]  # type: ignore[arg-type]  # a Cluster has base_url


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parked_seqs", [1, 0])
def test_a_park_keeps_the_kv_in_place_and_a_second_one_copies_the_oldest_out(
    batching: Cluster, references: list[list[tuple[int, str]]], parked_seqs: int
) -> None:
    """One generation at a time, one spare engine sequence (the default): the
    first park copies nothing (the parked job's KV stays in its sequence); a
    second park copies the older one out to the checkpoint store. With no
    spare sequence every park copies. The texts are the same either way."""
    c = batching
    c.start_worker("one", env={"PARKQ_PARKED_SEQS": str(parked_seqs),
                               "PARKQ_TEST_DECODE_DELAY_SECONDS": "0.003"})  # fmt: skip
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    bodies = _bodies()
    low = submit_stream(c.base_url, {**bodies[0], "priority": 0})
    low_id = low.headers["X-Job-Id"]
    seen = {low_id: read_events(low, limit=20)}
    middle = submit_stream(c.base_url, {**bodies[1], "priority": 5})
    middle_id = middle.headers["X-Job-Id"]
    wait_until(lambda: job(c.base_url, low_id)["state"] == "parked", timeout=60)
    seen[middle_id] = read_events(middle, limit=20)
    time.sleep(1.5)  # three heartbeats: what the worker holds outside the engine
    assert (_held_bytes(c) == 0) == (parked_seqs == 1)
    top = submit_stream(c.base_url, {**bodies[2], "max_tokens": 600, "priority": 10})
    wait_until(lambda: job(c.base_url, middle_id)["state"] == "parked", timeout=60)
    wait_until(lambda: _held_bytes(c) > 0, timeout=30)  # the oldest park, copied out
    streams = [seen.get(r.headers["X-Job-Id"], []) + read_events(r) for r in (low, middle, top)]
    for got, ref in zip(streams[:2], references[:2], strict=True):
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)
    assert completion_text(streams[2]) == completion_text(references[2])
    wait_until(lambda: _held_bytes(c) == 0, timeout=30)  # every copy used up or freed


@pytest.mark.timeout(300)
def test_across_two_workers_of_two_sequences_the_lowest_job_makes_room(
    batching: Cluster, references: list[list[tuple[int, str]]]
) -> None:
    """Four sequences on two workers, all busy: an interactive request parks
    exactly one job, the one with the lowest key, wherever it runs."""
    c = batching
    two = {"PARKQ_MAX_SEQS": "2", "PARKQ_TEST_DECODE_DELAY_SECONDS": "0.002"}
    c.start_worker("left", env=two)
    c.start_worker("right", env=two)
    wait_until(lambda: c.workers_alive() == 2, timeout=60)
    bodies = [{**b, "priority": p} for b, p in zip(_bodies()[:4], (3, 1, 4, 2), strict=True)]
    resps = [submit_stream(c.base_url, body) for body in bodies]
    ids = [r.headers["X-Job-Id"] for r in resps]
    # 50 tokens at 2 ms or more each: every job is past its minimum run time.
    wait_until(lambda: all(job(c.base_url, j)["tokens"] > 50 for j in ids), timeout=60)
    short = submit_stream(c.base_url, {"prompt": "hi", "max_tokens": 8, "priority": "interactive"})
    assert read_events(short)[-1][1] == "[DONE]"
    streams = [read_events(r) for r in resps]
    assert [job(c.base_url, j)["preemptions"] for j in ids] == [0, 1, 0, 0]  # priority 1
    for got, ref in zip(streams, references[:4], strict=True):
        assert completion_text(got) == completion_text(ref)
        assert logprob_tokens(got) == logprob_tokens(ref)


@pytest.mark.timeout(300)
def test_the_fast_mode_batches_parks_and_resumes_every_job_to_its_end(batching: Cluster) -> None:
    """PARKQ_EXACT off: any batch width, flash attention, repacked weights where
    they work. A run is no longer bit-identical to one alone, but nothing else
    changes: jobs run side by side, a full engine parks its lowest for a
    better one, and every stream ends complete, each event once."""
    c = batching
    ids, streams = _two_running_then_a_better_one(c, "fast", {"PARKQ_EXACT": "0"})
    assert sum(job(c.base_url, j)["preemptions"] for j in ids) == 1
    for got, body in zip(streams, _bodies()[:2], strict=True):
        assert [i for i, _ in got] == list(range(1, len(got) + 1))
        assert got[-1][1] == "[DONE]"
        assert len(logprob_tokens(got)) == body["max_tokens"]
