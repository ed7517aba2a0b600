"""The worker side and the Redis data, in three rooms.

- ``jobs.engine``: everything that touches llama.cpp or tokens (the engine,
  kernel paths, sampling, grammars, tool calls, text, prompts, KV checkpoints,
  the test and demo models). A sampling bug is fixed here.
- ``jobs.store``: everything that touches Redis (the job store and its Lua
  scripts' typed results, the worker registry, telemetry, model identity, the
  RQ view, files and batches, event payloads, connections). A Redis race is
  fixed here or in the Lua scripts it runs (``scheduler/lua``).
- ``jobs.worker``: the worker process, which joins the two (its loop, one job's
  execution, the generation coroutine, where the KV lives, OpenAI chunks).

Imports run one way: ``jobs.worker`` may import both other rooms; ``jobs.engine``
and ``jobs.store`` import neither each other nor ``jobs.worker``; all three may
import ``scheduler`` (tests/unit/test_layers.py checks it). How the parts work
together: docs/design.md.
"""
