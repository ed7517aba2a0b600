"""What each API key may take: its tenant's policy, from the keys file.

``PARKQ_KEYS_FILE`` names a TOML file of tenants, each with its keys and the
limits its requests meet; the keys of ``PARKQ_API_KEYS`` (and
``PARKQ_ADMIN_KEYS``) keep working and take the file's ``[defaults]``::

    [defaults]                       # every key without a tenant table of its own
    max_priority = "interactive"

    [tenants.analytics]              # a tenant: its name, as `name:key` names one
    keys = ["sk-an-1", "sk-an-2"]    # any of them opens the API as this tenant
    max_priority = "batch"           # a request above it runs at it (and is told so)
    tokens_per_minute = 60000        # prompt + max output tokens, admitted per minute
    max_running = 4                  # its jobs running at once (more wait in the queue)
    max_queued = 100                 # its requests waiting at once (more get 429)
    upload_bytes = 104857600         # its uploaded files together (else PARKQ_FILES_MAX_BYTES)
    weight = 2                       # twice the turns of a weight-1 tenant's at each level
    parks_others = "batch"           # parks other tenants' batch work, never their interactive work

    [tenants.ops]
    keys = ["sk-ops"]
    admin = true                     # sees every tenant's jobs, files, batches and usage

A field the file does not know stops the process at start, as does a key
given twice: a limit that is silently not applied is worse than none.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.policy import priority_level

__all__ = ["NO_LIMITS", "KeyPolicy", "TenantKey", "load_keys_file"]


@dataclass(frozen=True)
class KeyPolicy:
    """A tenant's limits (None: none)."""

    #: The highest priority level its requests take; one above it runs at it.
    max_priority: int | None = None
    #: Prompt and (most) output tokens its requests may be admitted with per
    #: minute, as a token bucket of a minute's worth.
    tokens_per_minute: int | None = None
    #: Its jobs running at once (parked ones do not count), batch lines
    #: included: a job past it waits in the queue for one of them to end or park.
    max_running: int | None = None
    #: Its requests' jobs waiting at once (queued or parked); a request past it
    #: is refused with 429. A batch's lines do not count (its window bounds them).
    max_queued: int | None = None
    #: Its uploaded files together, in bytes (None: PARKQ_FILES_MAX_BYTES; 0: no limit).
    upload_bytes: int | None = None
    #: Its share beside other tenants at one priority level: its fair turns
    #: (scheduler/fairness.py) and each of its batches' lines waiting or
    #: running (``weight`` times PARKQ_BATCH_WINDOW).
    weight: float = 1.0
    #: Which running work of other tenants its requests may park: "all" (any
    #: lower level), or "batch" (only their batch-level work, at or below
    #: ``batch``; their interactive work is left to finish its turn).
    parks_others: str = "all"


NO_LIMITS = KeyPolicy()


@dataclass(frozen=True)
class TenantKey:
    """One key of the keys file."""

    secret: str
    name: str
    admin: bool = False
    policy: KeyPolicy = field(default=NO_LIMITS)


#: A tenant's weight lies between these (its turns are its expected tokens over
#: its weight: a weight near 0 would make them endless).
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0

_POLICY_FIELDS = {"max_priority", "tokens_per_minute", "upload_bytes", "weight", "parks_others",
                  "max_running", "max_queued"}  # fmt: skip
_TENANT_FIELDS = _POLICY_FIELDS | {"keys", "admin"}


def _policy(table: dict[str, Any], where: str, base: KeyPolicy) -> KeyPolicy:
    values: dict[str, Any] = {}
    if "max_priority" in table:
        value = table["max_priority"]
        try:
            values["max_priority"] = priority_level(value)
        except ValueError as exc:
            raise ValueError(f"{where}: max_priority: {exc}") from None
    for name in ("tokens_per_minute", "upload_bytes", "max_running", "max_queued"):
        if name in table:
            value = table[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {name} must be a whole number, 0 or more")
            # 0: no limit (upload_bytes 0 over PARKQ_FILES_MAX_BYTES too)
            values[name] = value if name == "upload_bytes" else value or None
    if "weight" in table:
        value = table["weight"]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (MIN_WEIGHT <= value <= MAX_WEIGHT)
        ):
            raise ValueError(f"{where}: weight must be a number from {MIN_WEIGHT} to {MAX_WEIGHT}")
        values["weight"] = float(value)
    if "parks_others" in table:
        value = table["parks_others"]
        if value not in ("all", "batch"):
            raise ValueError(f'{where}: parks_others must be "all" or "batch"')
        values["parks_others"] = value
    return KeyPolicy(**{**base.__dict__, **values})


def load_keys_file(path: str | Path) -> tuple[KeyPolicy, tuple[TenantKey, ...]]:
    """The file's defaults and its keys; raises ValueError naming what is wrong."""
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"PARKQ_KEYS_FILE: cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"PARKQ_KEYS_FILE {path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"defaults", "tenants"}
    if unknown:
        raise ValueError(f"PARKQ_KEYS_FILE {path}: unknown tables {sorted(unknown)} "
                         "(expected [defaults] and [tenants.NAME])")  # fmt: skip
    defaults_table = data.get("defaults", {})
    if not isinstance(defaults_table, dict) or set(defaults_table) - _POLICY_FIELDS:
        raise ValueError(f"PARKQ_KEYS_FILE {path}: [defaults] takes only "
                         f"{sorted(_POLICY_FIELDS)}")  # fmt: skip
    defaults = _policy(defaults_table, "[defaults]", NO_LIMITS)
    keys: list[TenantKey] = []
    seen: set[str] = set()
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError(f"PARKQ_KEYS_FILE {path}: [tenants] must hold tables [tenants.NAME]")
    for name, table in tenants.items():
        where = f"[tenants.{name}]"
        if not name.strip():
            raise ValueError(f"PARKQ_KEYS_FILE {path}: a tenant needs a name ([tenants.NAME])")
        if not isinstance(table, dict):
            raise ValueError(f"PARKQ_KEYS_FILE {path}: {where} must be a table")
        extra = set(table) - _TENANT_FIELDS
        if extra:
            raise ValueError(f"PARKQ_KEYS_FILE {path}: {where}: unknown fields {sorted(extra)} "
                             f"(known: {sorted(_TENANT_FIELDS)})")  # fmt: skip
        secrets = table.get("keys")
        if (not isinstance(secrets, list) or not secrets
                or not all(isinstance(s, str) and s.strip() for s in secrets)):  # fmt: skip
            raise ValueError(f"PARKQ_KEYS_FILE {path}: {where}: keys must be a list of "
                             "one or more non-empty strings")  # fmt: skip
        admin = table.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"PARKQ_KEYS_FILE {path}: {where}: admin must be true or false")
        policy = _policy(table, where, defaults)
        for secret in secrets:
            secret = secret.strip()
            if secret in seen:
                raise ValueError(f"PARKQ_KEYS_FILE {path}: a key is given twice ({where})")
            seen.add(secret)
            keys.append(TenantKey(secret=secret, name=name, admin=admin, policy=policy))
    return defaults, tuple(keys)
