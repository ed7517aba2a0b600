"""How many sequences a worker serves when nothing is set."""

from __future__ import annotations

from jobs.engine.capacity import kv_bytes_per_position, plan_sequences

GIB = 2**30
#: gemma-3-270m's metadata (the demo model): 18 layers, 1 KV head of 256.
GEMMA = {
    "general.architecture": "gemma3",
    "gemma3.block_count": "18",
    "gemma3.embedding_length": "640",
    "gemma3.attention.head_count": "4",
    "gemma3.attention.head_count_kv": "1",
    "gemma3.attention.key_length": "256",
    "gemma3.attention.value_length": "256",
}


def test_kv_per_position_from_the_metadata() -> None:
    assert kv_bytes_per_position(GEMMA) == 18 * 1 * (256 + 256) * 2
    # Without key/value lengths: the embedding split over the heads.
    llama = {"general.architecture": "llama", "llama.block_count": "32",
             "llama.embedding_length": "4096", "llama.attention.head_count": "32",
             "llama.attention.head_count_kv": "8"}  # fmt: skip
    assert kv_bytes_per_position(llama) == 32 * 8 * (128 + 128) * 2
    assert kv_bytes_per_position({}) is None
    assert kv_bytes_per_position({"general.architecture": "x"}) is None


def test_unset_means_eight_on_a_cpu_and_sixteen_on_a_gpu_when_memory_allows() -> None:
    kv = kv_bytes_per_position(GEMMA)
    cpu = plan_sequences(None, None, on_gpu=False, n_ctx=4096, kv_per_position=kv, memory=16 * GIB)
    assert (cpu.max_seqs, cpu.parked_seqs) == (8, 1)
    assert "default on a CPU" in cpu.reason and "72 MiB" in cpu.reason
    gpu = plan_sequences(None, None, on_gpu=True, n_ctx=4096, kv_per_position=kv, memory=80 * GIB)
    assert (gpu.max_seqs, gpu.parked_seqs) == (16, 4)


def test_short_memory_cuts_the_sequences_to_half_of_it() -> None:
    per_seq = 128 * 1024 * 4096  # a 7B-class model at 4,096 positions: 512 MiB
    plan = plan_sequences(None, None, on_gpu=False, n_ctx=4096, kv_per_position=128 * 1024,
                          memory=8 * GIB, model_bytes=4 * GIB)  # fmt: skip
    # (8 GiB - 4 GiB) / 2 = 2 GiB: 4 sequences, all generating (a park copies
    # its KV out instead: a few ms on a CPU).
    assert (plan.max_seqs, plan.parked_seqs) == (4, 0)
    assert (plan.max_seqs + plan.parked_seqs) * per_seq <= 2 * GIB
    assert "cut to fit" in plan.reason
    # Several workers on one machine share it.
    two = plan_sequences(None, None, on_gpu=False, n_ctx=4096, kv_per_position=128 * 1024,
                         memory=8 * GIB, model_bytes=4 * GIB, workers=2)  # fmt: skip
    assert (two.max_seqs, two.parked_seqs) == (2, 0)
    # Never below one generating sequence, whatever the memory says.
    none = plan_sequences(None, None, on_gpu=False, n_ctx=4096, kv_per_position=128 * 1024,
                          memory=GIB, model_bytes=4 * GIB)  # fmt: skip
    assert (none.max_seqs, none.parked_seqs) == (1, 0)


def test_what_is_set_is_kept() -> None:
    plan = plan_sequences(1, 0, on_gpu=True, n_ctx=4096, kv_per_position=None, memory=None)
    assert (plan.max_seqs, plan.parked_seqs) == (1, 0)
    assert "as set" in plan.reason
    # One set, the other chosen within what is left.
    plan = plan_sequences(4, None, on_gpu=False, n_ctx=4096, kv_per_position=2**20, memory=GIB)
    assert plan.max_seqs == 4 and plan.parked_seqs == 0  # 4 GiB each: nothing left to park
    unknown = plan_sequences(None, None, on_gpu=False, n_ctx=4096, kv_per_position=None,
                             memory=None)  # fmt: skip
    assert (unknown.max_seqs, unknown.parked_seqs) == (8, 1) and "unknown" in unknown.reason
