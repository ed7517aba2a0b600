"""Everything that touches llama.cpp or tokens.

``llama`` (the only module that imports ``llama_cpp``: the engine, its batched
decode and per-sequence KV, the vocabulary), ``kernels`` (which kernel path and
batch widths are safe here), ``capacity`` (how many sequences by default),
``sampling``, ``constraints`` (structured outputs), ``toolcalls``,
``textstream`` (UTF-8 holding, stop sequences), ``prompts`` (chat prompts with
control tokens from the template only), ``request`` (a generation's request as
the web stores it with its job), ``checkpoints`` (parked KV in RAM, the
prefix cache), ``testmodel`` and ``demo_model``. Imports nothing from
``jobs.store`` or ``jobs.worker``.
"""
