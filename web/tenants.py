"""Who is asking, and what they may see.

With API keys set, each key is a tenant (keys under one name, ``name:key``,
are one tenant): every job, file and batch records its creator's tenant in
its ``owner`` field (a hash, never the key), and every read, cancel, list and
download filters by it. Another tenant's id answers 404, as an id that does
not exist (a 403 would confirm it does). Admin keys (PARKQ_ADMIN_KEYS) see
every tenant's. Without keys there is one tenant, and everyone is it.

Records written before keys were set have no owner: only admin keys see them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from flask import g, has_request_context

from scheduler.settings import ApiKey
from scheduler.tenancy import NO_LIMITS, KeyPolicy

__all__ = [
    "NOBODY",
    "OPEN",
    "Caller",
    "caller",
    "caller_of",
    "label_of",
    "policy_of",
    "sees",
    "tenant_of",
]


@dataclass(frozen=True)
class Caller:
    #: What the records this caller creates hold in ``owner`` ('' without keys).
    tenant: str
    #: The key's name for logs and metrics (``key-<8 hex>`` for an unnamed key;
    #: '' without keys).
    label: str
    #: Sees every tenant's jobs, files and batches.
    admin: bool
    #: The limits its requests meet (scheduler/tenancy.py).
    policy: KeyPolicy = field(default=NO_LIMITS)


#: Without API keys (and outside any request: the janitor, a batch's thread).
OPEN = Caller(tenant="", label="", admin=True)
#: With API keys, on the routes anyone may call (liveness, the sign-in page).
NOBODY = Caller(tenant="-", label="", admin=False)


def tenant_of(key: ApiKey) -> str:
    """The tenant of ``key``: a hash of its name if it has one, else of the key."""
    who = f"name\0{key.name}" if key.name else f"key\0{key.secret}"
    return hashlib.sha256(f"parkq tenant\0{who}".encode()).hexdigest()[:32]


def caller_of(key: ApiKey) -> Caller:
    tenant = tenant_of(key)
    return Caller(tenant=tenant, label=key.name or f"key-{tenant[:8]}", admin=key.admin,
                  policy=key.policy)  # fmt: skip


def policy_of(keys: tuple[ApiKey, ...], tenant: str) -> KeyPolicy:
    """The limits of ``tenant``'s keys (work done outside its requests: a batch's
    lines, queued by whichever process moves the batch on)."""
    for key in keys:
        if tenant and tenant_of(key) == tenant:
            return key.policy
    return NO_LIMITS


def label_of(keys: tuple[ApiKey, ...], tenant: str) -> str:
    """``tenant``'s name for metrics and usage (``key-<8 hex>`` for an unnamed
    key; ``tenant-<8 hex>`` for one no key opens now; '' without keys)."""
    if not tenant:
        return ""
    for key in keys:
        if tenant_of(key) == tenant:
            return key.name or f"key-{tenant[:8]}"
    return f"tenant-{tenant[:8]}"


def caller() -> Caller:
    """The caller of the current request (:data:`OPEN` outside a request)."""
    if not has_request_context():
        return OPEN
    found: Caller = g.get("parkq_caller", OPEN)
    return found


def sees(owner: str | bytes | None) -> bool:
    """Whether the current caller may see a record whose ``owner`` is ``owner``."""
    who = caller()
    if who.admin:
        return True
    if isinstance(owner, bytes):
        owner = owner.decode()
    return (owner or "") == who.tenant
