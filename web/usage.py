"""What each tenant used: ``GET /v1/usage``, in the shape of OpenAI's usage API
(``/v1/organization/usage/completions``: a page of time buckets, each with one
result per key name), from the hourly counts the workers keep in Redis.

A finished job counts its ``usage`` (prompt and completion tokens, and one
request) for its tenant in the same Lua call that ends it, so the counts equal
the sum of the usage fields of the tenant's finished responses (a response of
``n`` choices counts its prompt once and one request per choice). A park
counts one park and the tokens the job had generated since its last park
(``parked_tokens``: work set aside, replayed where its KV was not kept). A
cancelled or failed job counts the tokens it generated as
``unfinished_tokens`` (a stream may have delivered them). A caller sees its
own tenant; an admin key sees every tenant, one result each.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from flask import Blueprint, jsonify, request

from jobs.store.telemetry import as_text
from web.errors import BadRequest
from web.runtime import current
from web.tenants import caller, label_of

__all__ = ["FIELDS", "bp", "hourly", "tenant_totals"]

bp = Blueprint("usage", __name__)

#: What is counted per tenant (Redis field suffix -> result field).
FIELDS = {
    "prompt": "input_tokens",
    "completion": "output_tokens",
    "requests": "num_model_requests",
    "parked": "parked_tokens",
    "parks": "parks",
    "unfinished": "unfinished_tokens",
}
_WIDTHS = {"1h": 3600, "1d": 86400}
#: Most buckets one page holds (OpenAI's limit for 1h buckets is 168).
MAX_BUCKETS = 168


def _int_arg(name: str, default: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be a whole number of seconds (Unix time).",
                         param=name) from None  # fmt: skip


@bp.get("/v1/usage")
def usage() -> Any:
    """Usage per tenant in buckets of ``bucket_width`` (``1h``, the default, or
    ``1d``) from ``start_time`` (default: 24 hours ago) to ``end_time`` (now)."""
    now = int(time.time())
    width_name = request.args.get("bucket_width", "1h")
    if width_name not in _WIDTHS:
        raise BadRequest("'bucket_width' must be '1h' or '1d'.", param="bucket_width")
    width = _WIDTHS[width_name]
    start = _int_arg("start_time", now - 86400)
    end = _int_arg("end_time", now)
    if end <= start:
        raise BadRequest("'end_time' must be after 'start_time'.", param="end_time")
    start -= start % width
    if -(-(end - start) // width) > MAX_BUCKETS:
        raise BadRequest(f"At most {MAX_BUCKETS} buckets at a time: narrow the range or widen "
                         "the buckets.", param="start_time")  # fmt: skip
    runtime = current()
    who = caller()
    keys = runtime.settings.api_key_entries
    hours = list(range(start - start % 3600, end, 3600))
    buckets: dict[int, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for hour, row in zip(hours, hourly(hours, None if who.admin else who.tenant), strict=True):
        b = hour - hour % width
        for tenant, used in row.items():
            counts = buckets[b][tenant]
            for what, n in used.items():
                counts[what] = counts.get(what, 0) + n
    data = []
    for b in range(start, end, width):
        results = []
        for tenant, counts in sorted(buckets.get(b, {}).items()):
            result: dict[str, Any] = {"object": "organization.usage.completions.result"}
            result.update({name: counts.get(field, 0) for field, name in FIELDS.items()})
            result.update(input_cached_tokens=0, api_key_id=label_of(keys, tenant) or None,
                          project_id=None, user_id=None, model=None, batch=None)  # fmt: skip
            results.append(result)
        data.append({"object": "bucket", "start_time": b, "end_time": b + width,
                     "results": results})  # fmt: skip
    return jsonify({"object": "page", "data": data, "has_more": False, "next_page": None})


def hourly(hours: list[int], tenant: str | None = None) -> list[dict[str, dict[str, int]]]:
    """Each hour's counts (:data:`FIELDS`) by tenant, read in one pipeline;
    ``tenant``: that tenant's fields alone (the cost does not grow with the
    other tenants)."""
    store = current().store
    own = [f"{tenant}|{what}" for what in FIELDS]
    with store.r.pipeline(transaction=False) as p:
        for hour in hours:
            if tenant is None:
                p.hgetall(store.keys.usage(hour))
            else:
                p.hmget(store.keys.usage(hour), own)
        got = p.execute()
    out: list[dict[str, dict[str, int]]] = []
    for row in got:
        if tenant is not None:
            row = dict(zip(own, row, strict=True))
        counts: dict[str, dict[str, int]] = defaultdict(dict)
        for raw_field, raw_value in row.items():
            if raw_value is None:
                continue
            who, _, what = as_text(raw_field).rpartition("|")
            if what in FIELDS:
                counts[who][what] = int(raw_value)
        out.append(counts)
    return out


def tenant_totals(counters: dict[str, float]) -> dict[str, dict[str, float]]:
    """All-time usage per tenant from the counters hash (``usage|<tenant>|<what>``)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for name, value in counters.items():
        if name.startswith("usage|"):
            tenant, _, what = name.removeprefix("usage|").rpartition("|")
            out[tenant][what] = value
    return out
