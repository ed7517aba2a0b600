"""The OpenAI Files API: batch input files (JSONL) in, output files out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request

from jobs.store.batches import BatchStore
from web.errors import BadRequest, NotFound, PayloadTooLarge
from web.runtime import current
from web.tenants import caller, sees

__all__ = ["JSON_SPACE", "batch_store", "bp", "file_meta", "jsonl_lines"]

bp = Blueprint("files", __name__)


#: What JSON counts as whitespace (RFC 8259): a line of only these is blank.
JSON_SPACE = " \t\r\n"


def jsonl_lines(content: bytes) -> Iterator[tuple[int, str]]:
    """The lines of a JSON Lines file that are not blank, each with its number
    (from 1, blank lines counted). The file is UTF-8 (UnicodeDecodeError if not;
    a BOM at its start is dropped) and split at "\\n" only, a "\\r" before it
    dropped: U+2028, U+0085, a form feed and the like are characters of a line,
    as JSON strings may hold them raw (``str.splitlines`` splits at them). A
    last line needs no newline."""
    text = content.decode("utf-8-sig")
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip(JSON_SPACE):
            yield n, line.removesuffix("\r")


def batch_store() -> BatchStore:
    return BatchStore(current().store)


def file_meta(file_id: str) -> dict[str, Any]:
    """A file's description; 404 if there is none, or it is another tenant's."""
    store = batch_store()
    record = store.file_record(file_id)
    if record is None or not sees(record.get("owner")):
        raise NotFound(f"No file with id '{file_id}'.", param="file_id")
    return store.file_object(record)


@bp.post("/v1/files")
def upload_file() -> Any:
    limit = current().settings.batch_max_file_bytes
    if request.content_length is not None and request.content_length > limit + 65536:
        raise PayloadTooLarge(f"The file is larger than the limit of {limit} bytes.")
    request.max_content_length = limit + 65536  # the file plus the form's other parts
    purpose = request.form.get("purpose")
    upload = request.files.get("file")
    if upload is None:
        raise BadRequest("Missing the multipart field 'file'.", param="file")
    if purpose != "batch":
        raise BadRequest("Only purpose 'batch' is supported.", param="purpose")
    content = upload.read(limit + 1)
    if len(content) > limit:
        raise PayloadTooLarge(f"The file is larger than the limit of {limit} bytes.")
    try:
        lines = sum(1 for _ in jsonl_lines(content))
    except UnicodeDecodeError:
        raise BadRequest("The file is not valid UTF-8 text.", param="file") from None
    max_lines = current().settings.batch_max_lines
    if lines == 0:
        raise BadRequest("The file holds no requests (one JSON object per line).", param="file")
    if lines > max_lines:
        raise BadRequest(
            f"The file holds {lines} requests; a batch takes at most {max_lines}.", param="file"
        )
    settings = current().settings
    store = batch_store()
    own = caller().policy.upload_bytes  # the keys file's, for this tenant (0: none)
    quota = own if own is not None else settings.files_max_bytes
    if quota:  # per tenant; the message names the caller's usage alone
        used = store.uploaded_bytes(caller().tenant)
        if used + len(content) > quota:
            where = ("upload_bytes, this tenant's in PARKQ_KEYS_FILE" if own is not None
                     else "PARKQ_FILES_MAX_BYTES, per API key")  # fmt: skip
            raise PayloadTooLarge(
                f"Your uploaded files hold {used} of the {quota} bytes one tenant may keep "
                f"({where}); this one ({len(content)} bytes) does "
                "not fit. Delete files (DELETE /v1/files/<id>) or wait for them to expire.",
                code="files_quota_exceeded",
            )
    now = time.time()
    ttl = settings.file_ttl_seconds
    expires = int(now + ttl) if ttl else None
    name = upload.filename or "batch.jsonl"
    meta = store.create_file(name, purpose, content, now, expires_at=expires,
                             owner=caller().tenant)  # fmt: skip
    return jsonify(meta)


@bp.get("/v1/files")
def list_files() -> Any:
    who = caller()
    files = batch_store().list_files(request.args.get("purpose"),
                                     None if who.admin else who.tenant)  # fmt: skip
    return jsonify({"object": "list", "data": files, "has_more": False})


@bp.get("/v1/files/<file_id>")
def get_file(file_id: str) -> Any:
    return jsonify(file_meta(file_id))


@bp.get("/v1/files/<file_id>/content")
def file_content(file_id: str) -> Any:
    file_meta(file_id)
    content = batch_store().file_content(file_id)
    if content is None:
        raise NotFound(f"No content for file '{file_id}'.", param="file_id")
    return Response(content, mimetype="application/jsonl")


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> Any:
    file_meta(file_id)
    if not batch_store().delete_file(file_id):
        raise NotFound(f"No file with id '{file_id}'.", param="file_id")
    return jsonify({"id": file_id, "object": "file", "deleted": True})
