"""A whole (non-streamed) OpenAI response assembled from a job's streamed chunks."""

from __future__ import annotations

from typing import Any

from jobs.generation import GenerationRequest

__all__ = ["assemble"]


def assemble(
    job_id: str, gen: GenerationRequest, chunks: list[dict[str, Any]], usage: Any, index: int = 0
) -> dict[str, Any]:
    """The non-streamed response body of a job from its streamed chunks (its
    one choice has ``index``)."""
    finish = None
    text: list[str] = []
    chat_lp: list[Any] = []
    tool_calls: list[Any] = []
    cmpl_lp: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish = choice.get("finish_reason") or finish
            lp = choice.get("logprobs")
            if gen.kind == "chat":
                text.append(choice["delta"].get("content") or "")
                tool_calls.extend(choice["delta"].get("tool_calls") or [])
                if lp:
                    chat_lp.extend(lp["content"])
            else:
                text.append(choice.get("text") or "")
                if lp:
                    for key, values in cmpl_lp.items():
                        values.extend(lp[key])
    base = {"id": job_id, "created": gen.created, "model": gen.model, "usage": usage}
    if gen.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if tool_calls:
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in tool_calls
            ]
        logprobs = {"content": chat_lp} if gen.logprobs else None
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {**base, "object": "chat.completion", "choices": [choice]}
    logprobs_c = cmpl_lp if gen.logprobs else None
    text_ = "".join(text)
    choice = {"index": index, "text": text_, "logprobs": logprobs_c, "finish_reason": finish}
    return {**base, "object": "text_completion", "choices": [choice]}
