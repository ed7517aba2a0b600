"""A child process for the width tests: ``python -m tests.widthrun MODEL WIDTH
POSITIONS [flash]`` fills WIDTH sequences with text to about POSITIONS each
(chunks of fixed boundaries, calls of their own), then decodes a few steps of
each alone and the same steps of all of them in one call per step, and prints
as JSON whether every logit agreed, bit for bit (``flash``: with flash
attention). On the CPU (what the K-quant tests check), whatever the build.
``python -m tests.widthrun MODEL alone POSITIONS THREADS``: :func:`alone`.
``python -m tests.widthrun MODEL prompts WIDTH POSITIONS [flash] [floors]``:
:func:`prompts`.

A process of its own: llama.cpp reads its kernel switches (``GGML_CPU_TILED_MM``)
once per process, so each setting needs a fresh one. Two threads, whatever the
machine: flash attention's split of a lone sequence's cells needs two.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from jobs.engine.llama import LlamaEngine

STEPS = 6
N_BATCH = 256


def run(model: str, width: int, positions: int, flash: bool = False) -> dict[str, object]:
    engine = LlamaEngine(model, n_ctx=positions + 64 + 16 * width + STEPS, n_batch=N_BATCH,
                         n_seq_max=width, extra_buffers=False, n_gpu_layers=0, n_threads=2,
                         flash_attn=flash)  # fmt: skip
    text = engine.tokenize("Each sequence reads its own part of this long and winding text. ")
    length = {s: positions + 16 * s for s in range(width)}

    def token(s: int, p: int) -> int:
        return text[(11 * s + p) % len(text)]

    for s in range(width):
        for start in range(0, length[s], N_BATCH):
            end = min(length[s], start + N_BATCH)
            engine.eval([token(s, p) for p in range(start, end)], start, s)
    alone = {}
    for s in range(width):
        alone[s] = [engine.eval([token(s, p)], p, s) for p in range(length[s], length[s] + STEPS)]
        engine.truncate(length[s], s)
    for step in range(STEPS):
        calls = [(s, token(s, length[s] + step), length[s] + step) for s in range(width)]
        for (s, _, pos), got in zip(calls, engine._decode(calls), strict=True):
            if not np.array_equal(got, alone[s][step]):
                diff = float(np.max(np.abs(got - alone[s][step])))
                return {"equal": False, "sequence": s, "position": pos, "max_abs_diff": diff}
    engine.close()
    return {"equal": True, "positions": max(length.values()) + STEPS}


def alone(model: str, positions: int, threads: int) -> dict[str, object]:
    """One sequence with flash attention on ``threads`` threads: a prompt of
    ``positions`` tokens, 6 steps, its KV saved, cleared and restored (a park in
    place of the worker's), 6 more: a digest of every logit, and whether the
    restored steps matched those of a run without the park."""
    import hashlib

    engine = LlamaEngine(model, n_ctx=positions + 64, n_batch=N_BATCH, n_seq_max=1,
                         extra_buffers=False, n_gpu_layers=0, n_threads=threads,
                         flash_attn=True)  # fmt: skip
    text = engine.tokenize("Each sequence reads its own part of this long and winding text. ")
    prompt = [text[p % len(text)] for p in range(positions)]
    logits = np.zeros(1)
    for start in range(0, positions, N_BATCH):
        logits = engine.eval(prompt[start : start + N_BATCH], start, 0)
    steps: list[np.ndarray] = []

    def step(logits: np.ndarray, pos: int) -> np.ndarray:
        steps.append(logits)
        return engine.eval([int(np.argmax(logits))], pos, 0)

    pos = positions
    for _ in range(STEPS):
        logits, pos = step(logits, pos), pos + 1
    state, at, mark = bytes(engine.save_seq(0)), pos, logits
    for _ in range(STEPS):
        logits, pos = step(logits, pos), pos + 1
    straight = steps[STEPS:]
    engine.clear(0)
    engine.load_seq(state, 0)
    steps = steps[:STEPS]
    logits, pos = mark, at
    for _ in range(STEPS):
        logits, pos = step(logits, pos), pos + 1
    resumed = all(np.array_equal(a, b) for a, b in zip(straight, steps[STEPS:], strict=True))
    digest = hashlib.sha256(b"".join(x.tobytes() for x in steps)).hexdigest()
    engine.close()
    return {"digest": digest, "resumed": resumed}


def prompts(model: str, width: int, positions: int, flash: bool, floors: bool) -> dict[str, object]:
    """WIDTH prompts of about POSITIONS tokens each (lengths differing by 37, so
    their last chunks differ), each prefilled alone (chunks at fixed
    boundaries, calls of their own) and then all of them chunk by chunk, the
    chunks of one index in one call (:meth:`LlamaEngine.prefill`); then a few
    decode steps of each alone and of all together. Whether every logit after
    each prompt and every step agreed, bit for bit; ``floors``: prompt calls
    on the tiled paths (the exact worker's engine), else llama.cpp's own."""
    engine = LlamaEngine(model, n_ctx=positions + 64 + 37 * width + STEPS, n_batch=N_BATCH,
                         n_seq_max=width, extra_buffers=False, n_gpu_layers=0, n_threads=2,
                         flash_attn=flash, prompt_floors=floors)  # fmt: skip
    engine.plan_prefill(width)
    text = engine.tokenize("Each sequence reads its own part of this long and winding text. ")
    length = {s: positions + 37 * s for s in range(width)}

    def token(s: int, p: int) -> int:
        return text[(11 * s + p) % len(text)]

    def chunks(s: int) -> list[tuple[int, list[int], int]]:
        return [(s, [token(s, p) for p in range(a, min(length[s], a + N_BATCH))], a)
                for a in range(0, length[s], N_BATCH)]  # fmt: skip

    def steps(s: int) -> list[tuple[int, int, int]]:
        return [(s, token(s, p), p) for p in range(length[s], length[s] + STEPS)]

    alone = {}
    for s in range(width):
        logits = [engine.eval(tokens, pos, s) for _, tokens, pos in chunks(s)][-1]
        alone[s] = [logits] + [engine.eval([t], p, s) for _, t, p in steps(s)]
        engine.clear(s)
    got: dict[int, list[np.ndarray]] = {s: [] for s in range(width)}
    batched = 0
    for c in range(max(len(chunks(s)) for s in range(width))):
        group = [chunks(s)[c] for s in range(width) if c < len(chunks(s))]
        wide = [g for g in group if len(g[1]) > 1]
        for s, tokens, pos in [g for g in group if len(g[1]) == 1]:
            out = engine.eval(tokens, pos, s)
            if c == len(chunks(s)) - 1:
                got[s].append(out)
        if wide:
            batched += len(wide) > 1
            for (s, _, _), out in zip(wide, engine.prefill(wide), strict=True):
                if c == len(chunks(s)) - 1:
                    got[s].append(out)
    for step in range(STEPS):
        calls = [steps(s)[step] for s in range(width)]
        for (s, _, _), out in zip(calls, engine._decode(calls), strict=True):
            got[s].append(out)
    engine.close()
    for s in range(width):
        for i, (a, b) in enumerate(zip(alone[s], got[s], strict=True)):
            if not np.array_equal(a, b):
                after = "prompt" if i == 0 else f"step {i}"
                diff = float(np.max(np.abs(a - b)))
                return {"equal": False, "sequence": s, "after": after, "max_abs_diff": diff,
                        "batched": batched}  # fmt: skip
    return {"equal": True, "positions": max(length.values()) + STEPS, "batched": batched}


if __name__ == "__main__":
    if sys.argv[2] == "prompts":
        args = sys.argv[5:]
        print(json.dumps(prompts(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]),
                                 "flash" in args, "floors" in args)))  # fmt: skip
    elif sys.argv[2] == "alone":
        print(json.dumps(alone(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        flash = sys.argv[4:] == ["flash"]
        print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), flash)))
