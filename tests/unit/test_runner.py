import json

from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from jobs.store.events import DONE
from jobs.worker.generation import Generation
from jobs.worker.runner import CANCEL, drive
from tests.fakes import EOS, FakeEngine


def _gen(engine: FakeEngine, prompt: bytes, **kw) -> Generation:
    req = GenerationRequest(
        kind=kw.pop("kind", "completion"),
        model="fake",
        prompt_ids=list(prompt),
        max_tokens=kw.pop("max_tokens", 50),
        sampling=SamplingParams(temperature=0.0),
        **kw,
    )
    return Generation("job", req, engine.token_bytes, engine.is_eog)


def _texts(payloads: list[str]) -> str:
    out = []
    for p in payloads:
        if p == DONE:
            continue
        for c in json.loads(p)["choices"]:
            out.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(out)


def test_prefill_in_chunks_then_one_token_per_step() -> None:
    engine = FakeEngine(script=list(b"hi there"), prompt_len=10)
    emitted: list[str] = []
    outcome = drive(engine, _gen(engine, b"x" * 10), lambda p: emitted.extend(p) or 0, 4)
    assert engine.calls[:3] == [(4, 0), (4, 4), (2, 8)]
    assert all(n == 1 for n, _ in engine.calls[3:])
    assert outcome.state == "finished"
    assert _texts(emitted + outcome.payloads) == "hi there"
    assert outcome.payloads[-1] == DONE


def test_a_character_split_across_tokens_is_emitted_whole() -> None:
    engine = FakeEngine(script=list("é日".encode()))
    emitted: list[str] = []
    outcome = drive(engine, _gen(engine, b"p"), lambda p: emitted.extend(p) or 0, 8)
    texts = [json.loads(p)["choices"][0]["text"] for p in emitted]
    assert texts == ["é", "日"]
    assert json.loads(outcome.payloads[0])["choices"][0]["finish_reason"] == "stop"


def test_stop_sequence_and_length_finish_reasons() -> None:
    engine = FakeEngine(script=list(b"abcSTOPdef"))
    outcome = drive(engine, _gen(engine, b"p", stop=("STOP",)), lambda p: 0, 8)
    assert json.loads(outcome.payloads[-2])["choices"][0]["finish_reason"] == "stop"
    engine = FakeEngine(script=list(b"abcdef"))
    emitted: list[str] = []
    gen = _gen(engine, b"p", max_tokens=3)
    outcome = drive(engine, gen, lambda p: emitted.extend(p) or 0, 8)
    assert _texts(emitted + outcome.payloads) == "abc"
    assert gen.usage == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


def test_eos_ends_unless_ignored() -> None:
    engine = FakeEngine(script=[*b"ab", EOS, *b"cd"])
    gen = _gen(engine, b"p", max_tokens=10)
    drive(engine, gen, lambda p: 0, 8)
    assert gen.generated == list(b"ab")
    engine = FakeEngine(script=[*b"ab", EOS, *b"cd"])
    gen = _gen(engine, b"p", max_tokens=4, ignore_eos=True)
    drive(engine, gen, lambda p: 0, 8)
    assert gen.generated == [*b"ab", EOS, ord("c")]


def test_cancel_flag_stops_within_one_step() -> None:
    engine = FakeEngine()
    steps = []

    gen = _gen(engine, b"p", max_tokens=100)

    def emit(payloads: list[str]) -> int:
        steps.append(len(gen.generated))
        return CANCEL if len(gen.generated) >= 5 else 0

    outcome = drive(engine, gen, emit, 8)
    assert outcome.state == "cancelled"
    assert steps[-1] == 5 and len(gen.generated) == 5


def test_chat_stream_starts_with_the_role_and_can_report_usage() -> None:
    engine = FakeEngine(script=list(b"ok"))
    emitted: list[str] = []
    gen = _gen(engine, b"p", kind="chat", include_usage=True, logprobs=True, top_logprobs=2)
    outcome = drive(engine, gen, lambda p: emitted.extend(p) or 0, 8)
    first = json.loads(emitted[0])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    lp = json.loads(emitted[1])["choices"][0]["logprobs"]["content"][0]
    assert lp["token"] == "o" and len(lp["top_logprobs"]) == 2
    usage = json.loads(outcome.payloads[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
