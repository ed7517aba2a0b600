"""`GET /openapi.json`: the API's OpenAPI 3.1 description.

Request bodies come from the pydantic models that validate them, so the
description cannot drift from what the server accepts; every error response is
the OpenAI envelope.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel

from web.batches import BatchCreate
from web.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)

__all__ = ["bp", "spec"]

bp = Blueprint("openapi", __name__)

REF = "#/components/schemas/{model}"

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _obj(*required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": props}


STR = {"type": "string"}
INT = {"type": "integer"}
OPT_STR = {"type": ["string", "null"]}
OPT_INT = {"type": ["integer", "null"]}

CHOICES = {"type": "array", "items": {"type": "object"}}
COMPLETION = _obj("id", "object", "created", "model", "choices", id=STR, object=STR,
                  created=INT, model=STR, choices=CHOICES)  # fmt: skip
JOB = _obj("id", "object", "state", id=STR, object={"const": "job"}, state=STR)
FILE = _obj(
    "id", "object", "bytes", "created_at", "filename", "purpose", "status",
    id=STR, object={"const": "file"}, bytes=INT, created_at=INT, filename=STR,
    purpose=STR, status=STR,
)  # fmt: skip
BATCH = _obj(
    "id", "object", "endpoint", "input_file_id", "status", "request_counts", "created_at",
    id=STR, object={"const": "batch"}, endpoint=STR, input_file_id=STR, status=STR,
    output_file_id=OPT_STR, error_file_id=OPT_STR, created_at=INT,
    request_counts=_obj("total", "completed", "failed", total=INT, completed=INT, failed=INT),
)  # fmt: skip
LIST = _obj("object", "data", object={"const": "list"}, data={"type": "array"})
MODEL = _obj("id", "object", "created", "owned_by", id=STR, object={"const": "model"},
             created=INT, owned_by=STR)  # fmt: skip
#: One server-sent event: `id:` (the job's event number) and `data:` (a JSON chunk or [DONE]).
SSE_EVENT = _obj("data", data=STR, id=STR, event=STR)

ERRORS = {
    "400": "Invalid request (the message names the field)",
    "401": "Missing or invalid API key (when keys are set)",
    "404": "No such object",
    "409": "Not possible in the object's state (the message says why)",
    "410": "Expired (the message says what is left and where)",
    "413": "Body over the size limit",
    "503": "Not now, with Retry-After: the server's streams are all taken (code server_busy), "
    "the job store is unavailable (store_unavailable), or the live workers serve another "
    "model than this server's (model_mismatch)",
}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


#: What the HTTP server (gunicorn) answers itself, before the app: a request line
#: over its limit (an absurdly long URL).
URI_TOO_LONG = {
    "description": "Request line too long (answered by the HTTP server, as HTML)",
    "content": {"text/html": {"schema": STR}},
}


def _responses(ok: dict[str, Any], *codes: str, **extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    for code in ("400", "401", *codes):
        out[code] = _json({"$ref": "#/components/schemas/Error"}, ERRORS.get(code, "Error"))
    out["414"] = URI_TOO_LONG
    out.update(extra)
    return out


def _body(model: type[BaseModel], content: str = "application/json") -> dict[str, Any]:
    return {
        "required": True,
        "content": {content: {"schema": {"$ref": REF.format(model=model.__name__)}}},
    }


def _id(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": STR}


def _generation(model: type[BaseModel], summary: str) -> dict[str, Any]:
    ok = {
        "description": "The whole response, or with stream=true an SSE stream of chunks",
        "content": {
            "application/json": {"schema": COMPLETION},
            "text/event-stream": {"schema": SSE_EVENT},
        },
        "headers": {"X-Job-Id": {"schema": STR, "description": "The job id (SSE responses)"}},
    }
    too_many = _json({"$ref": "#/components/schemas/Error"}, "Queue full (with Retry-After)")
    too_many["headers"] = {"Retry-After": {"schema": STR, "required": True}}
    return {
        "summary": summary,
        "requestBody": _body(model),
        "responses": _responses(ok, "409", "413", "500", "503", **{"429": too_many}),
    }


def _link(operation: str, param: str) -> dict[str, Any]:
    return {"operationId": operation, "parameters": {param: "$response.body#/id"}}


#: What the description covers: every route of the app but these (the page,
#: its session, its state feed, the metrics and the description itself).
UNDESCRIBED = frozenset({"/", "/dashboard/login", "/dashboard/state", "/metrics", "/openapi.json"})


def spec(secured: bool = False) -> dict[str, Any]:
    """The description; ``secured``: API keys are required (Bearer)."""
    schemas: dict[str, Any] = {"Error": ERROR}
    for model in (ChatRequest, CompletionRequest, ResponsesRequest, TokenizeRequest,
                  DetokenizeRequest, BatchCreate):  # fmt: skip
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    paths: dict[str, Any] = {
        **_generation_paths(),
        **_responses_paths(),
        **_token_paths(),
        **_job_paths(),
        **_file_paths(),
        **_batch_paths(),
        **_health_paths(),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "parkq",
            "version": "0.1.0",
            "description": "OpenAI-compatible LLM jobs that park for interactive work.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
    if not secured:
        del doc["security"]
        del doc["components"]["securitySchemes"]
        for probe in ("/livez", "/readyz", "/healthz"):
            doc["paths"][probe]["get"].pop("security")
    _name_operations(paths)
    return doc


def _name_operations(paths: dict[str, Any]) -> None:
    """Operation ids, and links from what creates an object to what reads it."""
    for path, ops in paths.items():
        for method, op in ops.items():
            op["operationId"] = (
                f"{method}{path.replace('/', '_').replace('{', '').replace('}', '')}"
            )
    links = {
        "post_v1_files": {
            "GetFile": _link("get_v1_files_file_id", "file_id"),
            "GetFileContent": _link("get_v1_files_file_id_content", "file_id"),
            "DeleteFile": _link("delete_v1_files_file_id", "file_id"),
        },
        "post_v1_batches": {
            "GetBatch": _link("get_v1_batches_batch_id", "batch_id"),
            "CancelBatch": _link("post_v1_batches_batch_id_cancel", "batch_id"),
        },
        "post_v1_completions": {
            "GetJob": _link("get_v1_jobs_job_id", "job_id"),
            "CancelJob": _link("delete_v1_jobs_job_id", "job_id"),
        },
        "post_v1_responses": {
            "GetResponse": _link("get_v1_responses_response_id", "response_id"),
            "CancelResponse": _link("post_v1_responses_response_id_cancel", "response_id"),
            "GetInputItems": _link("get_v1_responses_response_id_input_items", "response_id"),
            "DeleteResponse": _link("delete_v1_responses_response_id", "response_id"),
        },
    }
    for ops in paths.values():
        for op in ops.values():
            if op["operationId"] in links:
                op["responses"]["200"]["links"] = links[op["operationId"]]


def _generation_paths() -> dict[str, Any]:
    """Chat and text completions, and the model list."""
    return {
        "/v1/chat/completions": {"post": _generation(ChatRequest, "Chat completion")},
        "/v1/completions": {"post": _generation(CompletionRequest, "Text completion")},
        "/v1/models": {
            "get": {
                "summary": "This server's model, then any other model a live worker serves",
                "responses": _responses(_json(LIST)),
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model of the list, by its id",
                "parameters": [_id("model_id")],
                "responses": _responses(_json(MODEL), "404"),
            }
        },
        "/v1/usage": {
            "get": {
                "summary": "Tokens and requests per key name, in hourly or daily buckets",
                "parameters": [
                    {"name": "start_time", "in": "query", "schema": INT},
                    {"name": "end_time", "in": "query", "schema": INT},
                    {"name": "bucket_width", "in": "query", "schema": {"enum": ["1h", "1d"]}},
                ],
                "responses": _responses(_json(USAGE_PAGE)),
            }
        },
    }


USAGE_PAGE = _obj("object", "data", "has_more", object={"const": "page"},
                  data={"type": "array", "items": {"type": "object"}},
                  has_more={"type": "boolean"})  # fmt: skip


RESPONSE = _obj("id", "object", "created_at", "status", "model", "output",
                id=STR, object={"const": "response"}, created_at=INT, status=STR, model=STR,
                output={"type": "array", "items": {"type": "object"}})  # fmt: skip
#: One Responses API event: `event:` its type, `data:` it with its sequence_number.
RESPONSE_EVENT = _obj("event", "data", event=STR, data=STR, id=STR)


def _responses_paths() -> dict[str, Any]:
    """OpenAI's Responses API."""
    response = {
        "description": "The response (background: at once, queued), or with stream=true an "
        "SSE stream of its events",
        "content": {
            "application/json": {"schema": RESPONSE},
            "text/event-stream": {"schema": RESPONSE_EVENT},
        },
    }
    stream_params = [
        {"name": "stream", "in": "query", "schema": {"type": "boolean"}},
        {"name": "starting_after", "in": "query", "schema": INT},
    ]
    list_params = [
        {"name": "limit", "in": "query", "schema": INT},
        {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
        {"name": "after", "in": "query", "schema": STR},
    ]
    deleted = _obj("id", "object", "deleted", id=STR, object={"const": "response"},
                   deleted={"type": "boolean"})  # fmt: skip
    return {
        "/v1/responses": {
            "post": {
                "summary": "A response (a chat job; background: answered at once)",
                "requestBody": _body(ResponsesRequest),
                "responses": _responses(response, "404", "409", "413", "429", "503"),
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A response; with stream=true its events after starting_after",
                "parameters": [_id("response_id"), *stream_params],
                "responses": _responses(response, "404", "410", "503"),
            },
            "delete": {
                "summary": "Delete a response (stopped first if it runs)",
                "parameters": [_id("response_id")],
                "responses": _responses(_json(deleted), "404", "409"),
            },
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Cancel a background response",
                "parameters": [_id("response_id")],
                "responses": _responses(_json(RESPONSE), "404", "409"),
            }
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "A response's input items",
                "parameters": [_id("response_id"), *list_params],
                "responses": _responses(_json(LIST), "404"),
            }
        },
    }


def _token_paths() -> dict[str, Any]:
    """Tokenize and detokenize (parkq extensions)."""
    return {
        "/v1/tokenize": {
            "post": {
                "summary": "Token ids of a text or of chat messages (parkq extension)",
                "requestBody": _body(TokenizeRequest),
                "responses": _responses(
                    _json(
                        _obj(
                            "tokens",
                            "count",
                            "context_length",
                            tokens={"type": "array"},
                            count=INT,
                            context_length=INT,
                        )
                    ),
                    "413",
                ),
            }
        },
        "/v1/detokenize": {
            "post": {
                "summary": "The text of token ids (parkq extension)",
                "requestBody": _body(DetokenizeRequest),
                "responses": _responses(_json(_obj("text", text=STR)), "413"),
            }
        },
    }


def _job_paths() -> dict[str, Any]:
    """A job's state, cancel and event stream (parkq extensions)."""
    return {
        "/v1/jobs/{job_id}": {
            "get": {
                "summary": "A job's state",
                "parameters": [_id("job_id")],
                "responses": _responses(_json(JOB), "404"),
            },
            "delete": {
                "summary": "Cancel a job",
                "parameters": [_id("job_id")],
                "responses": _responses(
                    _json(JOB, "Cancelled"), "404", "409", **{"202": _json(JOB, "Cancelling")}
                ),
            },
        },
        "/v1/jobs/{job_id}/events": {
            "get": {
                "summary": "A job's SSE stream, replayed after Last-Event-ID",
                "parameters": [
                    _id("job_id"),
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": STR},
                ],
                "responses": _responses(
                    {"description": "SSE", "content": {"text/event-stream": {"schema": SSE_EVENT}}},
                    "404",
                    "410",
                    **{"204": {"description": "The client has every event: nothing to send"}},
                ),
            }
        },
        "/v1/jobs/{job_id}/result": {
            "get": {
                "summary": "An ended job's whole response (kept after its events expire)",
                "parameters": [_id("job_id")],
                "responses": _responses(_json(COMPLETION), "404", "409", "410"),
            }
        },
    }


def _file_paths() -> dict[str, Any]:
    """The Files API."""
    upload = _obj(
        "file", "purpose", file={"type": "string", "format": "binary"}, purpose={"enum": ["batch"]}
    )
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a batch input file (JSONL)",
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": upload}},
                },
                "responses": _responses(_json(FILE), "413"),
            },
            "get": {
                "summary": "Files",
                "parameters": [{"name": "purpose", "in": "query", "schema": STR}],
                "responses": _responses(_json(LIST)),
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "summary": "A file",
                "parameters": [_id("file_id")],
                "responses": _responses(_json(FILE), "404"),
            },
            "delete": {
                "summary": "Delete a file",
                "parameters": [_id("file_id")],
                "responses": _responses(
                    _json(
                        _obj(
                            "id",
                            "object",
                            "deleted",
                            id=STR,
                            object=STR,
                            deleted={"type": "boolean"},
                        )
                    ),
                    "404",
                ),
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's bytes",
                "parameters": [_id("file_id")],
                "responses": _responses(
                    {"description": "JSONL", "content": {"application/jsonl": {"schema": STR}}},
                    "404",
                ),
            }
        },
    }


def _batch_paths() -> dict[str, Any]:
    """The Batch API."""
    return {
        "/v1/batches": {
            "post": {
                "summary": "Create a batch",
                "requestBody": _body(BatchCreate),
                "responses": _responses(_json(BATCH), "404", "413", "503"),
            },
            "get": {
                "summary": "Batches, newest first",
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {**INT, "minimum": 1, "maximum": 100},
                    },
                    {"name": "after", "in": "query", "schema": STR},
                ],
                "responses": _responses(_json(LIST)),
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {
                "summary": "A batch",
                "parameters": [_id("batch_id")],
                "responses": _responses(_json(BATCH), "404"),
            }
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "Cancel a batch",
                "parameters": [_id("batch_id")],
                "responses": _responses(_json(BATCH), "404", "409"),
            }
        },
    }


def _health_paths() -> dict[str, Any]:
    """The probes: the process alive, the deployment ready."""
    ready = _ready_path("Redis reachable and workers serving this server's model alive")
    return {
        "/livez": {
            "get": {
                "summary": "The web process answers (asks nothing of Redis or the workers)",
                "security": [],
                "responses": {
                    "200": _json(_obj("status", status={"const": "ok"})),
                    "414": URI_TOO_LONG,
                },
            }
        },
        "/readyz": _ready_path("Ready: Redis reachable and a live worker serving this model"),
        "/healthz": ready,
    }


def _ready_path(summary: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "security": [],
            "responses": {
                "200": _json(_obj("status", "redis", "workers", status={"const": "ok"})),
                "503": _json(
                    _obj(
                        "status",
                        "redis",
                        "workers",
                        status={"enum": ["unavailable", "model_mismatch"]},
                        other_models={"type": "array", "items": STR},
                    ),
                    "Unavailable: Redis down, no live worker, or only workers serving another "
                    "model (other_models)",
                ),
                "414": URI_TOO_LONG,
            },
        }
    }


@bp.get("/openapi.json")
def openapi() -> Any:
    return jsonify(spec(secured=bool(current_app.extensions["parkq"].settings.api_key_list)))
