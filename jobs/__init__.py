"""The worker side and the Redis data: the engine, generation state, the worker
loop and one job's execution, where the KV lives, and the stores of jobs,
workers, measurements, files and batches. Imports ``scheduler`` only."""
