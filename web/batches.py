"""The OpenAI Files and Batch API: JSONL in, one batch-priority job per line,
JSONL out (an output file and an error file, each line with its ``custom_id``).

Batch state is derived from its jobs whenever the batch is read: the counts,
and, once every line has ended, the output files (written once, under a lock,
by whichever web process reads the batch first).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeVar

import redis
from flask import Blueprint, current_app, jsonify, request
from pydantic import BaseModel, ConfigDict, Field

from jobs.engine.request import GenerationRequest
from jobs.store.batches import BATCH_LEVEL, BatchStore, Item, new_id
from jobs.store.events import DONE
from jobs.store.scheduling import Cancelled
from scheduler.state import JobState
from web import webhooks
from web.errors import APIError, BadRequest, Conflict, NotFound
from web.files import batch_store, file_meta, jsonl_lines
from web.intake import (
    chat_job,
    check_model,
    completion_job,
    parse_json,
    read_body,
    unencodable,
)
from web.responses import assemble
from web.responses_api import batch_line_job, batch_result
from web.runtime import current
from web.schemas import ChatRequest, CompletionRequest, parse
from web.tenants import caller, sees

__all__ = ["bp"]

bp = Blueprint("batches", __name__)

ENDED = ("completed", "failed", "cancelled", "expired")
_WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 86400)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Annotated[str, Field(pattern=_WINDOW.pattern)] = "24h"
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None


class _LineError(Exception):
    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


def _line_job(
    raw: str, endpoint: str, seen: set[str], job_id: str
) -> tuple[str, GenerationRequest, dict[str, str]]:
    """The custom_id, job and extra record fields of one input line (to be job
    ``job_id``); raise :class:`_LineError` if invalid."""
    try:
        line = parse_json(raw)
    except ValueError as exc:
        raise _LineError("invalid_json_line", f"This line is not valid JSON: {exc}.") from None
    if not isinstance(line, dict):
        raise _LineError("invalid_request", "A line must be a JSON object.")
    if (where := unencodable(line)) is not None:
        custom = line.get("custom_id")
        raise _LineError(
            "invalid_text",
            f"'{where}' is not valid Unicode text: it holds a lone surrogate (such as "
            "\\ud800), which no UTF-8 text can carry.",
            custom if isinstance(custom, str) and unencodable(custom) is None else None,
        )
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError("missing_custom_id", "The line has no 'custom_id' (a string).")
    if custom_id in seen:
        raise _LineError(
            "duplicate_custom_id", f"The custom_id '{custom_id}' is used twice.", custom_id
        )
    seen.add(custom_id)
    if line.get("method", "POST") != "POST":
        raise _LineError("invalid_method", "The method must be 'POST'.", custom_id)
    if line.get("url") != endpoint:
        raise _LineError(
            "mismatched_url", f"The url must be the batch's endpoint '{endpoint}'.", custom_id
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise _LineError("invalid_request", "The line has no 'body' object.", custom_id)
    body = {**body, "stream": False, "priority": "batch"}
    try:
        if endpoint == "/v1/chat/completions":
            return custom_id, chat_job(_one_choice(parse(ChatRequest, body))), {}
        if endpoint == "/v1/responses":
            return custom_id, *batch_line_job(body, job_id)
        return custom_id, completion_job(_one_choice(parse(CompletionRequest, body))), {}
    except APIError as exc:
        raise _LineError(exc.code or "invalid_request", exc.message, custom_id) from None
    except redis.RedisError:
        raise  # the store's, not the line's: the batch's validation is tried again
    except Exception as exc:
        # A refusal no check above names (a bug of ours, found by this line): the
        # line's error all the same, never the whole batch's.
        current_app.logger.exception("batch line %r: refused by an unexpected error", custom_id)
        raise _LineError(
            "invalid_request", f"The request could not be read ({type(exc).__name__}).", custom_id
        ) from None


R = TypeVar("R", ChatRequest, CompletionRequest)


def _one_choice(req: R) -> R:
    if req.n != 1:
        raise BadRequest(
            "A batch line asks for one choice: 'n' must be 1 (send n lines instead).", param="n"
        )
    return req


def _error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


@bp.post("/v1/batches")
def create_batch() -> Any:
    """Accept a batch at once, as ``validating``; its lines are checked and
    tokenized by a thread of their own (a file of 50,000 lines would otherwise
    hold this request, and a web thread, for as long)."""
    req = parse(BatchCreate, read_body())
    check_model(current())
    window = _WINDOW.match(req.completion_window)
    assert window is not None  # the model's pattern
    meta = file_meta(req.input_file_id)
    if meta["purpose"] != "batch":
        raise BadRequest("The input file's purpose must be 'batch'.", param="input_file_id")
    batches = batch_store()
    now = time.time()
    batch_id = new_id("batch")
    after = req.output_expires_after
    keep = {"output_expires_seconds": str(after.seconds)} if after else {}
    # Its lines run at batch priority, or lower where the key's tenant is capped
    # below it, and wait for the tenant's token rate (scheduler/tenancy.py).
    policy = caller().policy
    if policy.max_priority is not None and policy.max_priority < BATCH_LEVEL:
        keep["level"] = str(policy.max_priority)
    if policy.tokens_per_minute:
        keep["tokens_per_minute"] = str(policy.tokens_per_minute)
    if policy.max_running:  # its lines count toward its tenant's running jobs
        keep["max_running"] = str(policy.max_running)
    if policy.weight != 1.0:  # its share: its lines waiting or running at a time
        lines = current().settings.batch_window
        keep["window"] = str(max(1, round(lines * policy.weight)))
        keep["weight"] = repr(policy.weight)  # and its fair turns at its level
    record = {
        "id": batch_id,
        "endpoint": req.endpoint,
        "input_file_id": req.input_file_id,
        "completion_window": req.completion_window,
        "created_at": str(int(now)),
        "expires_at": str(int(now) + int(window.group(1)) * 3600),
        "metadata": json.dumps(req.metadata),
        **keep,
        "invalid": "0",
        "errors": "[]",
        "window_enforced": "1",  # (batches of earlier releases never expire)
        "status": "validating",
    }
    who = caller()
    if who.tenant:
        record["owner"] = who.tenant
    batches.create_record(record, now)
    if who.label:
        batches.store.telemetry.count(f"requests_by_key:{who.label}")
        current_app.logger.info("batch %s: created for %s", batch_id, who.label)
    _start_validation(batches, batch_id)
    return jsonify(_batch_object(batches, batch_id))


#: Longest a validation may take before another web thread may start it again.
VALIDATION_SECONDS = 600


def _start_validation(batches: BatchStore, batch_id: str) -> None:
    """Validate the batch in a thread, unless one (in any process) already does."""
    if not batches.lock_validation(batch_id, VALIDATION_SECONDS):
        return
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    threading.Thread(
        target=_validate, args=(app, batch_id), name=f"validate {batch_id}", daemon=True
    ).start()


def _validate(app: Any, batch_id: str) -> None:
    """Check and tokenize every line; then queue the batch (or fail it)."""
    with app.app_context():
        batches = batch_store()
        try:
            record = batches.get(batch_id)
            if record is None or record.get("status") != "validating":
                return  # validated meanwhile: a reader saw it validating, then started this late
            _validate_lines(batches, batch_id)
        except Exception as exc:  # the batch fails with the reason; nothing is queued
            current_app.logger.exception("batch %s: validation failed", batch_id)
            error = {"code": "validation_failed", "message": str(exc), "param": None, "line": None}
            failed = {"status": "failed", "failed_at": str(int(time.time())),
                      "errors": json.dumps([error])}  # fmt: skip
            if batches.transition(batch_id, "validating", failed):
                _finalize(batches, batch_id, [], [])
        finally:
            batches.unlock_validation(batch_id)


def _validate_lines(batches: BatchStore, batch_id: str) -> None:
    record = _batch(batches, batch_id)
    content = batches.file_content(record["input_file_id"])
    if content is None:
        raise LookupError(
            f"The input file '{record['input_file_id']}' was deleted (or expired) before "
            "the batch's lines were read."
        )
    lines: list[tuple[str, str, str, dict[str, Any], dict[str, str]]] = []
    invalid: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, raw in jsonl_lines(content):
        job_id = new_id("batchreq")
        try:
            custom_id, gen, extra = _line_job(raw, record["endpoint"], seen, job_id)
        except _LineError as exc:
            message = f"Line {n}: {exc.message}"
            invalid.append(_error_line(exc.custom_id, exc.code, message))
            if len(errors) < 100:
                errors.append({"code": exc.code, "message": message, "param": None, "line": n})
            continue
        lines.append((job_id, custom_id, gen.kind, gen.to_json(), extra))
    runtime = current()
    for job_id, _, kind, gen_json, _ in lines:
        runtime.rq.create(job_id, f"batch {batch_id}: {kind} {len(gen_json['prompt_ids'])} tokens")
    # Lines stored by a validation that died with its process before the batch
    # left validating (none of them was fed): this one stores them again.
    for job_id in batches.forget_lines(batch_id):
        runtime.rq.canceled(job_id)
    now = time.time()
    owner = {"owner": record["owner"]} if record.get("owner") else {}
    if record.get("level"):
        owner["level"] = record["level"]  # its lines' level (a capped tenant's)
    batches.create_batch(
        {"id": batch_id, "invalid": str(len(invalid)), "errors": json.dumps(errors), **owner},
        lines,
        invalid,
        now,
    )
    status = "in_progress" if lines else "failed"
    if not batches.transition(
        batch_id, "validating", {"status": status, f"{status}_at": str(int(now))}
    ):
        # Cancelled while it was validated: its lines never run.
        for job_id in batches.drop_pending(batch_id):
            runtime.rq.canceled(job_id)
        _batch_object(batches, batch_id)  # finalizes it as cancelled
        return
    if lines:
        batches.feed(batch_id, now)
    else:
        _finalize(batches, batch_id, [], [])
    current_app.logger.info(
        "batch %s: %d requests queued, %d invalid lines", batch_id, len(lines), len(invalid)
    )


def _batch(batches: BatchStore, batch_id: str) -> dict[str, str]:
    """The batch's record; 404 if there is none, or it is another tenant's."""
    record = batches.get(batch_id)
    if record is None or not sees(record.get("owner")):
        raise NotFound(f"No batch with id '{batch_id}'.", param="batch_id")
    return record


def _batch_object(batches: BatchStore, batch_id: str) -> dict[str, Any]:
    """The batch as OpenAI describes it, brought up to date with its jobs."""
    record = _batch(batches, batch_id)
    status = record["status"]
    if status in ENDED and "total" not in record:
        # Failed before any line was queued: its error file is written now (or
        # by the thread that failed it, which holds the lock meanwhile).
        _finalize(batches, batch_id, [], [])
        record = _batch(batches, batch_id)
        status = record["status"]
    if status in ENDED:
        invalid = record["invalid"]
        total = int(record.get("total", invalid))
        completed, failed = int(record.get("completed", 0)), int(record.get("failed", invalid))
        if "total" not in record:
            # Another thread is writing its files (or died doing it: its lock
            # expires and a later read writes them): not ended until they are
            # there, since a client that sees an end reads the files' ids.
            status = "finalizing"
    elif status == "validating":
        _start_validation(batches, batch_id)  # again, if its validator died with its process
        total = completed = failed = 0
    else:
        # Past its window (a batch created since the window is enforced): its
        # open lines stop. Checked after its counts: one whose lines have all
        # ended is finalized as it is, not expired.
        past = bool(record.get("expired_at")) or (
            bool(record.get("window_enforced")) and time.time() >= int(record["expires_at"])
        )
        if status == "in_progress" and not past:
            batches.feed(batch_id)
        counts, items, states = batches.counts(batch_id, int(record["invalid"]))
        if status == "in_progress" and past and counts.open:
            _expire(batches, batch_id, record)  # again after an interrupted one: idempotent
            counts, items, states = batches.counts(batch_id, int(record["invalid"]))
        total, completed, failed = counts.total, counts.completed, counts.failed
        if counts.open == 0:
            _finalize(batches, batch_id, items, states)
            record = _batch(batches, batch_id)
            status = record["status"]
            if "total" in record:  # the counts its files were written with
                total, completed = int(record["total"]), int(record["completed"])
                failed = int(record["failed"])
        elif status == "finalizing":
            status = "in_progress"  # a finalization that died with its process: retried
    errors = json.loads(record.get("errors") or "[]")

    def ts(name: str) -> int | None:
        value = record.get(name)
        return int(value) if value else None

    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": status,
        "output_file_id": record.get("output_file_id") or None,
        "error_file_id": record.get("error_file_id") or None,
        "created_at": ts("created_at"),
        "in_progress_at": ts("in_progress_at"),
        "expires_at": ts("expires_at"),
        "finalizing_at": ts("finalizing_at"),
        "completed_at": ts("completed_at"),
        "failed_at": ts("failed_at"),
        "expired_at": ts("expired_at") if status == "expired" else None,
        "cancelling_at": ts("cancelling_at"),
        "cancelled_at": ts("cancelled_at"),
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": json.loads(record.get("metadata") or "null"),
        "usage": _usage(record) if "usage" in record else None,
    }


def _usage(record: dict[str, str]) -> dict[str, Any]:
    """The batch's token usage (its completed lines', summed when it ended)."""
    used = json.loads(record.get("usage") or "{}")
    inp, out = int(used.get("input", 0)), int(used.get("output", 0))
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": int(used.get("cached", 0))},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def _expire(batches: BatchStore, batch_id: str, record: dict[str, str]) -> None:
    """The batch's completion window has passed: its lines not yet run never
    will, the running ones are cancelled, and once they have stopped it ends
    ``expired`` (its completed lines' results in its output file). Marked
    first (no line is fed after it), then stopped; a stop that was cut short
    is done again by the next read (both steps are idempotent)."""
    runtime = current()
    now = time.time()
    if not record.get("expired_at") and not batches.transition(
        batch_id, "in_progress", {"expired_at": str(int(now))}
    ):
        return  # it left in_progress meanwhile (cancelled, finalized)
    for job_id in batches.drop_pending(batch_id):
        runtime.rq.canceled(job_id)
    for job_id, outcome in runtime.store.cancel_live(batches.live_jobs(batch_id), now).items():
        if outcome is Cancelled.CANCELLED:
            runtime.store.telemetry.count("jobs_cancelled")
            runtime.rq.canceled(job_id)
    if not record.get("expired_at"):
        current_app.logger.info("batch %s: expired (its %s window passed)", batch_id,
                                record.get("completion_window"))  # fmt: skip


def _result_line(batches: BatchStore, item: Item) -> tuple[dict[str, Any], Any]:
    """A finished line's output line, and its job's usage (chat's shape, or None)."""
    store = batches.store
    record = store.get(item.job) or {}
    gen = GenerationRequest.from_json(json.loads(record["request"]))
    chunks = [json.loads(data) for _, data in store.events_after(item.job, 0) if data != DONE]
    chunks = [c for c in chunks if "error" not in c]
    usage = json.loads(record.get("usage", "null"))
    body = batch_result(item.job, record) if "response" in record else None
    return {
        "id": f"batch_req_{item.job.removeprefix('batchreq_')}",
        "custom_id": item.custom_id,
        "response": {
            "status_code": 200,
            "request_id": item.job,
            "body": body if body is not None else assemble(item.job, gen, chunks, usage),
        },
        "error": None,
    }, usage


#: Lines of a batch's output written (and its lock renewed) at a time.
FINALIZE_CHUNK = 1000


def _final_line(
    batches: BatchStore,
    item: Item,
    state: str | None,
    stopped: str | None,
    err: list[dict[str, Any]],
    counts: dict[str, int],
) -> dict[str, Any] | None:
    """A line's output line, or None with its error line added to ``err`` (a
    line whose result cannot be read is an error line, not a failed batch)."""
    if state == JobState.FINISHED:
        try:
            line, usage = _result_line(batches, item)
        except (KeyError, ValueError, TypeError) as exc:  # its record or events unreadable
            # (a Redis error is not this line's: it propagates, the next read retries)
            current_app.logger.exception("batch line %s: result unreadable", item.job)
            err.append(_error_line(item.custom_id, "result_unreadable",
                                   f"The request's result could not be read: {exc}"))  # fmt: skip
            counts["failed"] += 1
            return None
        counts["completed"] += 1
        if isinstance(usage, dict):
            counts["input"] += int(usage.get("prompt_tokens") or 0)
            counts["output"] += int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            counts["cached"] += int(details.get("cached_tokens") or 0)
        return line
    if state == JobState.FAILED:
        message = (batches.store.get(item.job) or {}).get("error") or "The request failed."
        err.append(_error_line(item.custom_id, "request_failed", message))
        counts["failed"] += 1
    elif stopped == "expired" and state in (JobState.CANCELLED, None):
        err.append(_error_line(item.custom_id, "batch_expired", "The request was not run "
                               "within the batch's completion window."))  # fmt: skip
        counts["failed"] += 1
    elif state == JobState.CANCELLED or stopped == "cancelled":
        err.append(_error_line(item.custom_id, "batch_cancelled",
                               "The request was cancelled before it completed."))  # fmt: skip
    else:
        err.append(_error_line(item.custom_id, "result_expired", "The request's result expired."))
        counts["failed"] += 1
    return None


def _finalize(
    batches: BatchStore, batch_id: str, items: list[Item], states: list[str | None]
) -> None:
    """Write the output and error files of a batch whose lines have all ended."""
    if not batches.lock(batch_id):
        return  # another web thread or process is writing them
    try:
        record = _batch(batches, batch_id)
        if "total" in record:
            return  # already finalized
        # (A finalization that died after marking the batch `finalizing` left its
        # cancel in `cancelling_at`.)
        cancelled = record["status"] == "cancelling" or bool(record.get("cancelling_at"))
        # Expired only if its window stopped a line (all of them finished: completed).
        expired = (bool(record.get("expired_at")) and not cancelled
                   and any(state != JobState.FINISHED for state in states))  # fmt: skip
        stopped = "cancelled" if cancelled else "expired" if expired else None
        now = str(int(time.time()))
        if record["status"] != "failed":  # a failed batch stays failed meanwhile
            batches.update(batch_id, {"status": "finalizing", "finalizing_at": now})
        err: list[dict[str, Any]] = list(batches.invalid_lines(batch_id))
        counts = {"completed": 0, "failed": 0, "input": 0, "output": 0, "cached": 0}

        def output() -> Iterator[bytes]:
            """The output file in pieces of FINALIZE_CHUNK lines (the lock renewed
            for each); every line that is not a result goes to ``err``."""
            piece: list[str] = []
            for n, (item, state) in enumerate(zip(items, states, strict=True), start=1):
                line = _final_line(batches, item, state, stopped, err, counts)
                if line is not None:
                    piece.append(json.dumps(line) + "\n")
                if n % FINALIZE_CHUNK == 0:
                    batches.renew_lock(batch_id)
                    if piece:
                        yield "".join(piece).encode()
                        piece = []
            if piece:
                yield "".join(piece).encode()

        keep = record.get("output_expires_seconds")
        written_at = time.time()  # both files' created_at: their expiry's anchor
        expires = int(written_at) + (int(keep) if keep else
                                     batches.settings.batch_retention_seconds)  # fmt: skip
        owner = record.get("owner", "")
        written = batches.write_file(f"{batch_id}_output.jsonl", "batch_output", output(),
                                     written_at, expires, owner=owner)  # fmt: skip
        completed, failed = counts["completed"], counts["failed"]
        fields = {
            "total": str(len(items) + int(record["invalid"])),
            "completed": str(completed),
            "failed": str(failed + int(record["invalid"])),
            "usage": json.dumps({k: counts[k] for k in ("input", "output", "cached")}),
        }
        if written is not None:
            fields["output_file_id"] = written["id"]
        if err:
            content = "".join(json.dumps(x) + "\n" for x in err).encode()
            meta = batches.create_file(f"{batch_id}_error.jsonl", "batch_output", content,
                                       written_at, expires_at=expires, owner=owner)  # fmt: skip
            fields["error_file_id"] = meta["id"]
        if record["status"] == "failed":
            fields["status"] = "failed"
        elif cancelled:
            fields.update(status="cancelled", cancelled_at=now)
        elif expired:
            fields.update(status="expired")
        else:
            fields.update(status="completed", completed_at=now)
        status, store = fields["status"], batches.store
        if not batches.end(
            batch_id, fields, lambda p: webhooks.add(p, store, status, batch_id, time.time())
        ):
            return  # another finalizer ended it first (its lock had lapsed)
        batches.release_results(items)
        batches.retain(batch_id)
        current_app.logger.info(
            "batch %s: %s (%d completed, %d failed)",
            batch_id,
            fields["status"],
            completed,
            int(fields["failed"]),
        )
    finally:
        batches.unlock(batch_id)


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Any:
    return jsonify(_batch_object(batch_store(), batch_id))


@bp.get("/v1/batches")
def listbatch_store() -> Any:
    try:
        limit = int(request.args.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be an integer.", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100.", param="limit")
    batches = batch_store()
    who = caller()
    ids, more = batches.list_ids(request.args.get("after"), limit,
                                 None if who.admin else who.tenant)  # fmt: skip
    data = [_batch_object(batches, i) for i in ids]
    return jsonify({
        "object": "list",
        "data": data,
        "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None,
        "has_more": more,
    })  # fmt: skip


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Any:
    runtime = current()
    batches = batch_store()
    record = _batch(batches, batch_id)
    if record["status"] in ENDED:
        raise Conflict(
            f"Batch '{batch_id}' has already ended ({record['status']}).", code="batch_ended"
        )
    if record["status"] != "cancelling":
        now = time.time()
        batches.update(batch_id, {"status": "cancelling", "cancelling_at": str(int(now))})
        dropped = batches.drop_pending(batch_id)
        for job_id in dropped:
            runtime.rq.canceled(job_id)
        cancelled = runtime.store.cancel_live(batches.live_jobs(batch_id), now)
        for job_id, outcome in cancelled.items():
            if outcome is Cancelled.CANCELLED:
                runtime.store.telemetry.count("jobs_cancelled")
                runtime.rq.canceled(job_id)
        current_app.logger.info(
            "batch %s: cancelling (%d requests never queued)", batch_id, len(dropped)
        )
    return jsonify(_batch_object(batches, batch_id))
