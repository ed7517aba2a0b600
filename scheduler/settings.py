"""The one settings object of parkq.

Built once per entry point from the environment (prefix ``PARKQ_``) plus the
command-line overrides, frozen, and passed down. Nothing else reads
``os.environ``.
"""

from __future__ import annotations

import base64
import functools
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.keys import Keys
from scheduler.policy import Policy
from scheduler.preempt import PreemptPolicy
from scheduler.tenancy import NO_LIMITS, KeyPolicy, TenantKey, load_keys_file

__all__ = ["ApiKey", "Settings", "cache_root", "data_root", "load_settings", "parse_keys"]


@dataclass(frozen=True)
class ApiKey:
    """One key: an entry of PARKQ_API_KEYS or PARKQ_ADMIN_KEYS (``key`` or
    ``name:key``), or of PARKQ_KEYS_FILE (scheduler/tenancy.py), with the limits
    its tenant's requests meet."""

    secret: str
    name: str = ""
    admin: bool = False
    policy: KeyPolicy = field(default=NO_LIMITS)


def parse_keys(text: str | None, admin: bool = False) -> tuple[ApiKey, ...]:
    """The keys of a comma-separated list; an entry ``name:key`` names its key
    (the name is split at the first ``:``)."""
    out = []
    for entry in (text or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, secret = entry.partition(":")
        if not sep:
            name, secret = "", entry
        name, secret = name.strip(), secret.strip()
        if sep and not (name and secret):
            raise ValueError(f"an API key entry '{name}:…' needs a name and a key: 'name:key'")
        out.append(ApiKey(secret=secret, name=name, admin=admin))
    return tuple(out)


class Settings(BaseSettings):
    # An empty variable (e.g. `PARKQ_CHAT_FORMAT=` from compose) means "the default".
    model_config = SettingsConfigDict(
        env_prefix="PARKQ_", frozen=True, extra="ignore", env_ignore_empty=True
    )

    # Redis
    redis_url: str | None = Field(
        None,
        description="Redis URL. `parkq up` starts an embedded Redis when unset; "
        "`parkq web` and `parkq worker` require it. Redis Sentinel: "
        "`redis+sentinel://[:password@]host1:26379,host2:26379/mymaster[/db]` "
        "(`rediss+sentinel://` for TLS; the sentinels' own password as "
        "`?sentinel_password=`).",
    )
    durable_replicas: int | None = Field(
        None,
        ge=0,
        description="Replicas that must hold a new job, file or batch before the request "
        "that made it is answered (Redis WAIT), so a failover to one of them keeps it. "
        "Default 1 with a Sentinel URL, else 0. Past PARKQ_DURABLE_WAIT_MS (a replica down) "
        "the request is answered anyway, with a warning in the log; with several replicas "
        "Sentinel may promote one that had not acknowledged.",
    )
    durable_wait_ms: int = Field(
        500,
        ge=1,
        le=4000,
        description="How long a request waits for PARKQ_DURABLE_REPLICAS (below Redis "
        "clients' 5 s socket timeout).",
    )
    key_prefix: str = Field(
        "parkq", description="Prefix of every parkq key; two deployments can share a Redis."
    )
    queue_name: str = Field("parkq", description="RQ queue name shown by `rq info`.")
    data_dir: str | None = Field(
        None,
        description=(
            "Where `parkq up`'s embedded Redis keeps its data (append-only file), so that "
            "jobs, parked work, files and batches survive a restart; default "
            "$XDG_DATA_HOME/parkq (~/.local/share/parkq). `parkq up --ephemeral` keeps "
            "nothing."
        ),
    )

    # Model
    model: str | None = Field(
        None, description="Path of the GGUF model. Unset: the demo model is assembled and used."
    )
    model_alias: str | None = Field(
        None, description="Model name reported by the API; default: the file name without .gguf."
    )
    chat_format: str | None = Field(
        None,
        description="Named llama-cpp-python chat format (e.g. 'gemma'); "
        "unset: the model's own chat template.",
    )
    n_ctx: int = Field(4096, ge=0, description="Context size; 0 means the model's training size.")
    n_batch: int = Field(256, ge=1, description="Prefill chunk size in tokens.")
    max_seqs: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Sequences one worker generates at once (continuous batching): each "
        "step decodes one token of each stepping sequence, in as few engine calls as the "
        "batch widths proven exact here allow. Each sequence has its own n_ctx positions "
        "of KV memory. Unset: 8 on a CPU, 16 on a "
        "GPU, fewer if their KV would take more than half the free memory (`parkq up` and "
        "the worker say what they chose and why); 1 generates one job at a time.",
    )
    parked_seqs: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Engine sequences beyond PARKQ_MAX_SEQS that keep parked jobs' KV in "
        "place: a park copies nothing while one is free (the oldest is copied to the "
        "checkpoint store when a new park needs its sequence). Each costs n_ctx positions of "
        "KV memory; 0 copies every park out. Unset: 1 on a CPU, 4 on a GPU (a copy out of "
        "VRAM takes tens of ms), fewer if memory is short.",
    )
    exact: bool = Field(
        True,
        description="Every sequence gets, bit for bit, the tokens it would get alone: "
        "batched only as wide as these kernels allow (probed), several prompts in one "
        "prefill call and flash attention only on a CPU with parkq's llama.cpp and where "
        "the probe certifies them, no repacked weights. Off: the "
        "fastest kernels llama.cpp has here (repacked weights, flash attention, any batch "
        "width, prompts prefilled together); priorities, parks and "
        "resumes all still work, but a run is no longer identical to one alone (what "
        "other servers give), and a job replayed after its worker died ends with a "
        "replay_diverged error where the replay computes other tokens.",
    )
    interactive_pace: float = Field(
        1.3,
        ge=1.0,
        description="With several sequences: how much slower than alone an interactive "
        "stream may step while batch sequences share the engine (batch sequences sit out "
        "steps, taking turns, to keep it; measured step times decide).",
    )
    n_threads: int | None = Field(
        None, ge=1, description="Decode threads; unset: one per available core."
    )
    n_gpu_layers: int | None = Field(
        None,
        ge=-1,
        description="Model layers llama.cpp keeps on the GPU; unset or -1: all of them when "
        "llama.cpp was built with a GPU backend (CUDA, Metal, Vulkan...), else none; 0: run "
        "on the CPU. The worker logs the backend, the device and where the layers went.",
    )
    extra_buffers: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "llama.cpp's extra buffer types (weights repacked for AMX/AVX-512 kernels, on "
            "some CPUs they crash): 'auto' probes them once per machine and model in a child "
            "process and falls back to off if it dies; 'on' or 'off' forces."
        ),
    )
    cache_dir: str | None = Field(
        None,
        description=(
            "Cache directory (the assembled demo model, kernel probe verdicts); "
            "default ~/.cache/parkq."
        ),
    )

    # Web
    api_keys: str | None = Field(
        None,
        description="Comma-separated API keys, each `key` or `name:key`; when set, every "
        "route but the probes (/livez, /readyz, /healthz) needs `Authorization: Bearer <key>`, "
        "and each key sees only the "
        "jobs, files and batches it created (keys under one name are one tenant: rotate a "
        "key by adding the new one under the same name).",
    )
    keys_file: str | None = Field(
        None,
        description="A TOML file of tenants: their keys and the limits their requests meet "
        "(the highest priority, tokens per minute, an upload quota; docs/operations.md, "
        '"Tenants and their limits"). The keys of PARKQ_API_KEYS and PARKQ_ADMIN_KEYS '
        "take its [defaults]. Read at start.",
    )
    admin_keys: str | None = Field(
        None,
        description="Comma-separated admin keys (`key` or `name:key`): they open every route "
        "like API keys and see every tenant's jobs, files and batches (the dashboard shows "
        "them all).",
    )
    trusted_proxies: int = Field(
        0,
        ge=0,
        description="Reverse proxies in front of `parkq web` whose X-Forwarded-For and "
        "X-Forwarded-Proto headers are trusted (the client address for sign-in limits, HTTPS "
        "for the dashboard cookie's Secure flag); 0 trusts none.",
    )
    host: str = Field("127.0.0.1", description="Address the web server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the web server binds.")
    max_streams: int = Field(
        512,
        ge=1,
        description="Most open SSE streams and waiting non-streamed requests the web serves "
        "at once; past it a new one gets 503 server_busy with Retry-After (before any job is "
        "queued). A reconnect is refused the same way, and an interactive job with no reader "
        "for PARKQ_DISCONNECT_GRACE_SECONDS is abandoned: size it so reconnects find room.",
    )
    web_threads: int | None = Field(
        None,
        ge=1,
        description="Web server threads; default PARKQ_MAX_STREAMS + 32 (each open stream "
        "holds one; the 32 answer /healthz and every short request meanwhile).",
    )
    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest accepted request body.")
    disconnect_grace_seconds: float = Field(
        10.0,
        ge=0,
        description="An interactive job whose stream readers all left is cancelled after this "
        "long (a reconnect within it continues the stream); batch jobs run on without readers.",
    )
    max_queue: int = Field(
        10_000,
        ge=0,
        description="Most waiting jobs; beyond it requests get 429 with Retry-After (0: no limit).",
    )
    keepalive_seconds: float = Field(
        15.0, gt=0, description="Idle SSE streams get a comment line this often."
    )
    completions_default_max_tokens: int = Field(
        16, ge=1, description="max_tokens of /v1/completions when the request gives none."
    )

    # Worker
    worker_name: str | None = Field(None, description="Worker name; default host.pid.")
    worker_ttl: float = Field(
        10.0, gt=0, description="A worker whose heartbeat is older than this is dead."
    )
    heartbeat_seconds: float = Field(2.0, gt=0, description="Worker heartbeat period.")
    write_interval_seconds: float = Field(
        0.005,
        ge=0,
        description=(
            "A worker writes each decoding step's tokens to Redis and reads the job's flags "
            "(cancel, park) in the same round trip; when steps are faster than this (tiny "
            "models) it gathers the tokens of that long into one write. 0: every step."
        ),
    )
    batch_max_file_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1,
        description="Largest file /v1/files accepts, in bytes (files are kept in Redis).",
    )
    batch_max_lines: int = Field(
        50_000, ge=1, description="Most requests (lines) in one batch input file."
    )
    batch_retention_seconds: int = Field(
        30 * 86400,
        ge=60,
        description="An ended batch's record (status, counts, its lines' ids) and its output "
        "and error files are kept this long after it ends.",
    )
    file_ttl_seconds: int = Field(
        30 * 86400,
        ge=0,
        description="An uploaded file is deleted this long after its upload (its expires_at; "
        "0: kept until deleted). A batch already created from it keeps its lines.",
    )
    files_max_bytes: int = Field(
        1024**3,
        ge=0,
        description="One tenant's uploaded files together (an API key's, or those of the keys "
        "under one name; everyone's without keys), in bytes (they are kept in Redis): an "
        "upload past it is refused with 413 until that tenant's files are deleted or expire "
        "(0: no limit).",
    )
    batch_window: int = Field(
        4,
        ge=1,
        description="Lines of one batch waiting or running at a time; the rest wait in the "
        "batch, so a large batch neither fills the queue nor ages ahead of interactive work.",
    )
    fair_share: bool = Field(
        True,
        description="Tenants (the keys file's, or each key of PARKQ_API_KEYS) take turns by "
        "weight among the jobs waiting at one priority level: a tenant that sends many jobs "
        "at once pushes its own later jobs back, not other tenants'. Off: first come, first "
        "served within a level. Without keys there is one tenant and nothing changes.",
    )
    result_ttl: int = Field(
        86400, ge=1, description="Seconds a finished job's record and result are kept."
    )
    replay_seconds: int = Field(
        600,
        ge=1,
        description="Seconds a finished job's per-token events stay replayable (a reconnect "
        "with Last-Event-ID); then only its result is kept (GET /v1/jobs/<id>/result).",
    )
    janitor_seconds: float = Field(
        5.0,
        gt=0,
        description="How often `parkq web` compacts ended jobs and finalizes batches whose "
        "lines have all ended (without anyone reading them).",
    )
    usage_retention_seconds: int = Field(
        90 * 86400,
        ge=3600,
        description="How long each hour's usage per tenant (GET /v1/usage) is kept.",
    )
    webhook_url: str | None = Field(
        None,
        description="Where batch webhooks go (`batch.completed`, `batch.failed`, "
        "`batch.cancelled`, `batch.expired`), POSTed in OpenAI's shape and signed as "
        "Standard Webhooks (the openai client's `webhooks.unwrap` verifies them); each "
        "event is kept in Redis until the endpoint answers 2xx (unset: none are sent).",
    )
    webhook_secret: str | None = Field(
        None,
        description="The webhooks' signing secret: `whsec_` and base64, as OpenAI's (needed "
        "with PARKQ_WEBHOOK_URL).",
    )
    webhook_backoff_seconds: float = Field(
        5.0,
        gt=0,
        description="The pause after a webhook's first failed attempt; it doubles with each "
        "failure, up to an hour.",
    )
    webhook_retry_seconds: int = Field(
        72 * 3600,
        ge=60,
        description="How long a webhook event is retried (backing off, up to an hour apart) "
        "before it is dropped, logged and counted.",
    )

    # Scheduling policy
    priority_level_seconds: float = Field(
        60.0, gt=0, description="Seconds of waiting one priority level is worth."
    )
    aging_rate: float = Field(
        1.0,
        gt=0,
        description="Scales every job's key by one factor, so it never changes which job runs "
        "first; it only divides PARKQ_PREEMPT_MARGIN (a margin of 1 is 1/rate seconds of "
        "waiting). How waiting weighs against priority is PARKQ_PRIORITY_LEVEL_SECONDS.",
    )
    preempt: bool = Field(
        True, description="Park a running job for a better waiting one (off: priority order only)."
    )
    preempt_margin: float = Field(
        1.0,
        ge=0,
        description="A waiting job preempts only if its key beats the runner's by this much "
        "(in seconds of waiting).",
    )
    min_run_seconds: float = Field(
        0.1, ge=0, description="A job keeps the engine at least this long after it (re)starts."
    )
    affinity_seconds: float = Field(
        2.0,
        ge=0,
        description="A parked job waits this long for the worker holding its checkpoint "
        "before any idle worker may take it (re-prefill), or as long as it has run if that "
        "is longer (what a replay elsewhere would cost).",
    )
    checkpoint_bytes: int = Field(
        2 << 30, ge=0, description="RAM budget of a worker's KV checkpoints (LRU beyond it)."
    )
    prefix_cache_bytes: int = Field(
        512 << 20,
        ge=0,
        description="RAM budget of a worker's cache of finished prompts' KV, reused by "
        "requests that start the same way (a chat's next turn); 0 turns it off.",
    )
    crash_limit: int = Field(
        3, ge=1, description="A job whose worker died this many times fails instead of looping."
    )

    # Logging
    log_level: str = Field("INFO", description="Python logging level.")
    log_format: Literal["text", "json"] = Field("text", description="'text' or 'json' logs.")
    access_log: bool = Field(
        True,
        description="`parkq web` logs one line per HTTP request (logger `parkq.access`, at "
        "INFO): client address, method, path, status, milliseconds to its last byte, "
        "`stream` for a stream, and its request id (the probes /livez, /readyz and /healthz at "
        "DEBUG).",
    )

    @field_validator("model", "data_dir", "cache_dir", "keys_file", mode="before")
    @classmethod
    def _path(cls, v: object) -> object:
        """A path as a shell would give it: `~` and `$VAR` expanded, here, so
        every process reads the same file (an env file passes them unexpanded).
        A variable that is not set is an error, not a folder named after it."""
        if isinstance(v, str) and v:
            expanded = os.path.expandvars(v)
            unset = re.search(r"\$(\{)?[A-Za-z_][A-Za-z0-9_]*(?(1)\})", expanded)
            if unset:
                raise ValueError(f"{v!r} names {unset.group(0)}, which is not set")
            return os.path.expanduser(expanded)
        return v

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _key_list(cls, v: str | None) -> str | None:
        parse_keys(v)  # a malformed entry stops the process at start, with the reason
        return v

    @field_validator("keys_file")
    @classmethod
    def _keys_file(cls, v: str | None) -> str | None:
        if v:
            _read_keys_file(v)  # what is wrong with it stops the process at start
        return v or None

    @model_validator(mode="after")
    def _keys_once(self) -> Settings:
        entries = self.api_key_entries
        secrets = [k.secret for k in entries]
        if self.keys_file:
            _, in_file = _read_keys_file(self.keys_file)
            listed = {k.name for k in parse_keys(self.api_keys) + parse_keys(self.admin_keys)}
            both = listed & {k.name for k in in_file}
            if both:
                raise ValueError(f"the tenant {sorted(both)[0]!r} is named both in "
                                 "PARKQ_API_KEYS/PARKQ_ADMIN_KEYS and in PARKQ_KEYS_FILE: give "
                                 "its keys in the file")  # fmt: skip
        if len(secrets) != len(set(secrets)):
            raise ValueError("an API key is given twice (PARKQ_API_KEYS, PARKQ_ADMIN_KEYS and "
                             "PARKQ_KEYS_FILE together): each key opens one tenant")  # fmt: skip
        return self

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, v: str | None) -> str | None:
        if v and not v.lower().startswith(("http://", "https://")):
            raise ValueError("PARKQ_WEBHOOK_URL must be an http:// or https:// URL")
        return v or None

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_secret(cls, v: str | None) -> str | None:
        if v:
            # As the openai client reads it (webhooks.unwrap): `whsec_`, then padded
            # base64, decoded strictly; it would refuse every signature otherwise.
            key = b""
            if v.startswith("whsec_"):
                try:
                    key = base64.b64decode(v.removeprefix("whsec_"), validate=True)
                except ValueError:
                    key = b""
            if len(key) < 16:
                raise ValueError("PARKQ_WEBHOOK_SECRET must be `whsec_` and the padded "
                                 "base64 of 16 bytes or more, as OpenAI's signing secrets "
                                 "are")  # fmt: skip
        return v or None

    @model_validator(mode="after")
    def _webhook_pair(self) -> Settings:
        if self.webhook_url and not self.webhook_secret:
            raise ValueError("PARKQ_WEBHOOK_URL is set but PARKQ_WEBHOOK_SECRET is not: "
                             "webhooks are always signed")  # fmt: skip
        return self

    @property
    def wait_replicas(self) -> int:
        """PARKQ_DURABLE_REPLICAS, its default resolved."""
        if self.durable_replicas is not None:
            return self.durable_replicas
        scheme = (self.redis_url or "").split("://", 1)[0].lower()
        return 1 if scheme in ("redis+sentinel", "rediss+sentinel") else 0

    @property
    def api_key_entries(self) -> tuple[ApiKey, ...]:
        """Every key that opens the API: the API keys, the admin keys (both with
        the keys file's defaults), then the keys file's."""
        defaults, filed = _read_keys_file(self.keys_file) if self.keys_file else (NO_LIMITS, ())
        listed = parse_keys(self.api_keys) + parse_keys(self.admin_keys, admin=True)
        return tuple(replace(k, policy=defaults) for k in listed) + tuple(
            ApiKey(secret=k.secret, name=k.name, admin=k.admin, policy=k.policy) for k in filed
        )

    @property
    def api_key_list(self) -> tuple[str, ...]:
        """The secrets of :attr:`api_key_entries`."""
        return tuple(k.secret for k in self.api_key_entries)

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)

    @property
    def policy(self) -> Policy:
        return Policy(level_seconds=self.priority_level_seconds, aging_rate=self.aging_rate)

    @property
    def preempt_policy(self) -> PreemptPolicy:
        return PreemptPolicy(margin=self.preempt_margin, min_run_seconds=self.min_run_seconds)


def data_root(data_dir: str | None) -> Path:
    """``data_dir`` (PARKQ_DATA_DIR), else $XDG_DATA_HOME/parkq or ~/.local/share/parkq."""
    if data_dir:
        return Path(data_dir).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "parkq"


def cache_root(cache_dir: str | None) -> Path:
    """The cache directory: ``cache_dir`` (PARKQ_CACHE_DIR), else ~/.cache/parkq."""
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "parkq"


@functools.lru_cache(maxsize=4)
def _read_keys_file(path: str) -> tuple[KeyPolicy, tuple[TenantKey, ...]]:
    """The keys file, read once per process (at start: a change takes a restart,
    so every web process of one start agrees on who may do what)."""
    return load_keys_file(path)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with explicit (non-None) overrides on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**given)
