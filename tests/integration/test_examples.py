"""docs/examples/reconnect.py against a real `parkq up` (tiny model): a chat
stream with the default sampling, its connection cut mid-stream twice, comes
out whole, each piece once, the same text as a stream never cut."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests

from tests.integration.conftest import start_parkq, stop_parkq

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reconnect", ROOT / "docs/examples/reconnect.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Iterator[str]:
    proc, url = start_parkq(tiny_model, None)
    yield url
    assert stop_parkq(proc) == 0


BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": 300, "seed": 11, "ignore_eos": True}  # fmt: skip


def test_the_reconnect_example_gets_every_piece_once(
    base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = _example()
    whole = "".join(example.chat_stream(BODY, base))
    assert len(whole) > 100
    real = requests.Response.iter_lines
    connections: list[int] = []

    def cut(self: requests.Response, *args: Any, **kwargs: Any) -> Iterator[Any]:
        connections.append(1)
        for n, line in enumerate(real(self, *args, **kwargs)):
            if len(connections) <= 2 and n == 40:  # the first two connections break
                raise requests.exceptions.ChunkedEncodingError("connection cut")
            yield line

    monkeypatch.setattr(requests.Response, "iter_lines", cut)
    assert "".join(example.chat_stream(BODY, base)) == whole
    assert len(connections) == 3
