from __future__ import annotations

import fakeredis
import pytest

from jobs.store.scheduling import Store
from scheduler.settings import Settings


@pytest.fixture
def settings() -> Settings:
    return Settings(redis_url="redis://fake", n_ctx=0, keepalive_seconds=0.2)


@pytest.fixture
def fake_redis() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def store(fake_redis: fakeredis.FakeRedis, settings: Settings) -> Store:
    return Store(fake_redis, settings)
