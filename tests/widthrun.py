"""A child process for the width tests: ``python -m tests.widthrun MODEL WIDTH
POSITIONS [flash]`` fills WIDTH sequences with text to about POSITIONS each (chunks of
fixed boundaries, calls of their own), then decodes a few steps of each alone
and the same steps of all of them in one call per step, and prints as JSON
whether every logit agreed, bit for bit (``flash``: with flash attention). On
the CPU (what the K-quant tests check), whatever the build.

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


if __name__ == "__main__":
    flash = sys.argv[4:] == ["flash"]
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), flash)))
