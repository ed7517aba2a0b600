"""The keys file (scheduler/tenancy.py): what it gives each key, and every
mistake in it stopping the process at start with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scheduler.settings import Settings
from scheduler.tenancy import NO_LIMITS, KeyPolicy, load_keys_file

GOOD = """
[defaults]
max_priority = "interactive"

[tenants.analytics]
keys = ["sk-an-1", "sk-an-2"]
max_priority = "batch"
tokens_per_minute = 60000
upload_bytes = 1000
weight = 2
parks_others = "batch"
max_running = 2
max_queued = 0

[tenants.ops]
keys = ["sk-ops"]
admin = true
max_priority = 20
"""


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"keys-{abs(hash(text))}.toml"
    path.write_text(text)
    return str(path)


def test_each_key_gets_its_tenant_s_policy_and_listed_keys_the_defaults(tmp_path: Path) -> None:
    settings = Settings(api_keys="plain:sk-plain", admin_keys="root:sk-root",
                        keys_file=_file(tmp_path, GOOD))  # fmt: skip
    by_secret = {k.secret: k for k in settings.api_key_entries}
    assert set(by_secret) == {"sk-plain", "sk-root", "sk-an-1", "sk-an-2", "sk-ops"}
    analytics = KeyPolicy(max_priority=0, tokens_per_minute=60000, upload_bytes=1000, weight=2.0,
                          parks_others="batch", max_running=2, max_queued=None)  # fmt: skip
    assert by_secret["sk-an-1"].policy == by_secret["sk-an-2"].policy == analytics
    assert by_secret["sk-an-1"].name == "analytics" and not by_secret["sk-an-1"].admin
    assert by_secret["sk-ops"].admin and by_secret["sk-ops"].policy.max_priority == 20
    defaults = KeyPolicy(max_priority=10)
    assert by_secret["sk-plain"].policy == by_secret["sk-root"].policy == defaults
    assert by_secret["sk-root"].admin
    assert Settings(api_keys="sk-x").api_key_entries[0].policy is NO_LIMITS


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a]\nkeys = ['k']\nmax_waiting = 3\n", "unknown fields"),
        ("[tenants.a]\nkeys = ['k']\nmax_running = 1.5\n", "max_running"),
        ("[tenants.a]\nkeys = ['k']\nmax_queued = -1\n", "max_queued"),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", "given twice"),
        ("[tenants.a]\nkeys = []\n", "one or more"),
        ("[tenants.a]\nkeys = ['k']\nmax_priority = 'urgent'\n", "max_priority"),
        ("[tenants.a]\nkeys = ['k']\ntokens_per_minute = -5\n", "tokens_per_minute"),
        ("[tenants.a]\nkeys = ['k']\nweight = 0\n", "weight"),
        ("[tenants.a]\nkeys = ['k']\nweight = 1e-308\n", "weight must be a number from"),
        ("[tenants.a]\nkeys = ['k']\nweight = 1e9\n", "weight must be a number from"),
        ("[tenants.a]\nkeys = ['k']\nweight = nan\n", "weight must be a number from"),
        ("[tenants.a]\nkeys = ['k']\nadmin = 'yes'\n", "admin"),
        ("[tenants.a]\nkeys = ['k']\nparks_others = 'none'\n", "parks_others"),
        ("[defaults]\nkeys = ['k']\n", "[defaults] takes only"),
        ("[tenant.a]\nkeys = ['k']\n", "unknown tables"),
        ("[tenants.a\n", "not valid TOML"),
        ('[tenants.""]\nkeys = ["k"]\n', "needs a name"),
    ],
)
def test_a_mistake_in_the_file_is_named(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"(?s).*" + re.escape(says)):
        load_keys_file(_file(tmp_path, text))


def test_the_file_and_the_key_lists_cannot_disagree(tmp_path: Path) -> None:
    path = _file(tmp_path, GOOD)
    with pytest.raises(ValueError, match="given twice"):
        Settings(api_keys="sk-an-1", keys_file=path)
    with pytest.raises(ValueError, match="named both"):
        Settings(api_keys="analytics:sk-other", keys_file=path)
    with pytest.raises(ValueError, match="cannot read"):
        Settings(keys_file=str(tmp_path / "missing.toml"))
