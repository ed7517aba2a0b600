"""PARKQ_REDIS_URL's Sentinel form, and passwords kept out of output."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from jobs.store.connect import connect, parse_sentinel_url
from tools.checks import redact


def test_a_sentinel_url_names_its_sentinels_service_db_and_passwords() -> None:
    url = "redis+sentinel://:pw@h1:26379,h2,[::1]:26380/mymaster/2?sentinel_password=sp"
    parsed = parse_sentinel_url(url)
    assert parsed.sentinels == [("h1", 26379), ("h2", 26379), ("::1", 26380)]
    assert (parsed.service, parsed.db, parsed.password) == ("mymaster", 2, "pw")
    assert parsed.sentinel_password == "sp" and parsed.username is None and not parsed.tls
    tls = parse_sentinel_url("rediss+sentinel://ann:p%40ss@h1/svc")
    assert (tls.username, tls.password, tls.db, tls.tls) == ("ann", "p@ss", 0, True)


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel:///svc",  # no sentinel
        "redis+sentinel://h1",  # no service
        "redis+sentinel://h1/svc/x",  # a db that is not a number
        "redis+sentinel://h1/svc/0/more",
        "redis+sentinel://h1:port/svc",
        "redis+sentinel://h1/svc?sentinel_pasword=typo",
        "redis://h1/0",
    ],
)
def test_a_malformed_sentinel_url_is_refused_with_the_reason(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_connect_asks_the_sentinels_for_the_primary() -> None:
    client = connect("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/3")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster"
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    plain = connect("redis://127.0.0.1:1/4")
    assert isinstance(plain, redis.Redis)
    assert plain.connection_pool.connection_kwargs["db"] == 4


def test_passwords_never_reach_output() -> None:
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert redact("redis://h:6379") == "redis://h:6379"
    shown = redact("redis+sentinel://:pw@h1:26379,h2/mymaster/0?sentinel_password=sp")
    assert shown == "redis+sentinel://:***@h1:26379,h2/mymaster/0?sentinel_password=***"
    assert redact("redis://h/0?password=pw&db=1") == "redis://h/0?password=***&db=1"


class _Info:
    """A client whose INFO says ``version`` (or refuses INFO)."""

    def __init__(self, version: str | None) -> None:
        self.version = version

    def info(self, section: str) -> dict[str, str]:
        import redis

        if self.version is None:
            raise redis.ResponseError("ERR unknown command 'INFO'")
        return {"redis_version": self.version}


def test_a_redis_older_than_6_2_is_refused_with_what_to_do() -> None:
    from jobs.store.connect import too_old

    said = too_old(_Info("6.0.16"))
    assert said is not None and "6.0.16 is too old" in said and "6.2 or newer" in said
    for fine in ("6.2.14", "7.0.15", "7.2.4", "8.0.0"):
        assert too_old(_Info(fine)) is None
    assert too_old(_Info(None)) is None  # INFO renamed away: cannot tell, not refused
    assert too_old(_Info("unstable")) is None
