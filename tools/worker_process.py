"""`parkq worker`: one worker process. It picks the kernel path, loads the
model once, checks how many sequences one decode call may take, announces the
model it serves, and runs the worker loop until a signal parks its jobs."""

from __future__ import annotations

import faulthandler
import logging
import signal
from importlib import metadata
from typing import Any

import click

from jobs.engine.capacity import sequence_plan
from jobs.engine.kernels import (
    TILED_FLOOR,
    OpChoice,
    cpu_only_build,
    cuda_device,
    exact_kernels,
    exact_prompts,
    invariant_batch_size,
    keep_attention_unsplit,
    keep_cuda_invariant,
    keep_decode_untiled,
    patch_level,
    prompt_floors,
    prompts_together,
    worker_kernels,
)
from jobs.engine.llama import LlamaEngine, NotRepeatable, build_info, device_key
from jobs.engine.opcheck import flash_unchecked
from jobs.store.connect import connect
from jobs.store.identity import identify
from jobs.worker.loop import Worker, default_worker_name
from scheduler.settings import Settings
from web.app import model_name

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    """Serve jobs until SIGTERM or SIGINT (the first parks the running jobs and
    signs off; a second exits at once)."""
    faulthandler.enable()  # a crash inside llama.cpp leaves the Python stack in the log
    if settings.max_seqs is None or settings.parked_seqs is None:
        try:
            plan = sequence_plan(settings)
        except (ValueError, RuntimeError, OSError) as exc:
            raise click.ClickException(f"cannot load the model {settings.model}: {exc}") from None
        settings = settings.model_copy(
            update={"max_seqs": plan.max_seqs, "parked_seqs": plan.parked_seqs}
        )
        log.info(
            "%d sequences, %d parked in place: %s",
            plan.max_seqs,
            plan.parked_seqs,
            plan.reason,
        )
    assert settings.max_seqs is not None and settings.parked_seqs is not None
    device = device_key(settings.n_gpu_layers)
    gpu, cuda = device != "CPU", cuda_device(device)
    if settings.exact and cuda:
        # Before llama.cpp's first CUDA op here (it reads the switch once).
        on, said = keep_cuda_invariant(cuda)
        (log.info if on else log.warning)("%s", said)
    kernels = worker_kernels(settings)
    log.info(
        "llama.cpp extra buffer types %s: %s",
        "on" if kernels.extra_buffers else "off",
        kernels.reason,
    )
    ops = None
    floor = ""
    if settings.exact:
        at, said = keep_decode_untiled()
        floor = f", {TILED_FLOOR}={at}"
        if prompt_floors(gpu):
            log.info("%s: decode calls narrower than %d columns take the one-column "
                     "product; prompt calls take the tiled K-quant product at every size "
                     "(the run-time floor)", said, at)  # fmt: skip
        elif patch_level() >= 1:
            log.info("%s: llama.cpp's tiled K-quant product takes calls of %d columns or "
                     "more (prompt chunks), narrower ones the one-column product (every "
                     "decode width below it)", said, at)  # fmt: skip
        else:
            log.warning("%s is set, but this llama.cpp is not the build parkq installs "
                        "(python -m tools.llamapatch ensure) and ignores it: on x86 its tiled "
                        "K-quant product takes over from 8 columns", said)  # fmt: skip
    flash = False
    if settings.exact:
        flash, said = keep_attention_unsplit(gpu, cuda)
        unchecked = flash_unchecked(settings.model or "") if flash else []
        if unchecked:
            flash, said = False, ("flash attention off: the op check does not build this "
                                  f"model's {', '.join(unchecked)}")  # fmt: skip
    if settings.exact and settings.max_seqs > 1:
        ops = exact_kernels(settings, settings.n_ctx, gpu=gpu, flash=flash)
        if flash and ops.size < settings.max_seqs:
            plain = exact_kernels(settings, settings.n_ctx, gpu=gpu)
            if plain.size > ops.size:
                # Said loudly: workers of one model should run one attention, or a
                # job replayed from one on another may end with replay_diverged.
                log.warning("flash attention off after all: the op check certified %d per "
                            "call with it (%s), %d without; other workers of this model "
                            "may run it", ops.size, ops.how, plain.size)  # fmt: skip
                flash, ops = False, plain
                said = "flash attention off (refused by the op check)"
        log.info("per-op batching check: %s", ops.how)
        if ops.hint:
            log.info("%s", ops.hint)
    if settings.exact:
        log.info("%s", said)
    floors = settings.exact and prompt_floors(gpu)
    prompts = None
    if floors and settings.max_seqs > 1:
        if kernels.extra_buffers:
            log.warning("each prompt prefilled in a call of its own: repacked weights "
                        "(PARKQ_EXTRA_BUFFERS) compute a row by the width of its pass")  # fmt: skip
        elif not cpu_only_build():
            log.warning("each prompt prefilled in a call of its own: a GPU build takes wide "
                        "prompt passes to the GPU")  # fmt: skip
        else:
            prompts = exact_prompts(settings, settings.n_ctx, flash=flash)
            log.info("per-op check of prompt calls: %s", prompts.how)
    try:
        engine = LlamaEngine(
            settings.model or "",
            n_ctx=settings.n_ctx,
            n_batch=settings.n_batch,
            n_threads=settings.n_threads,
            n_seq_max=settings.max_seqs + settings.parked_seqs,
            chat_format=settings.chat_format,
            extra_buffers=kernels.extra_buffers,
            n_gpu_layers=settings.n_gpu_layers,
            exact=settings.exact,
            flash_attn=flash,
            prompt_floors=floors,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(f"cannot load the model {settings.model}: {exc}") from None
    log.info("llama.cpp: %s", build_info())
    log.info("model %s: %s", settings.model, engine.placement())
    exactness = "one sequence per decode call: exact without a batching check"
    if not settings.exact:
        exactness = "PARKQ_EXACT=0: a sequence beside others may get other tokens than alone"
    if settings.max_seqs > 1:
        if ops is not None:
            try:
                verdict = invariant_batch_size(engine, ops.size, settings.cache_dir)
            except NotRepeatable as exc:
                raise click.ClickException(
                    f"llama.cpp does not repeat itself on this machine ({exc}): no park can "
                    "resume bit-exactly here. PARKQ_EXACT=0 runs without that promise."
                ) from None
            size = verdict.size
            how = f"per-op check: {ops.how}; whole model: {verdict.how}"
            # The per-op check ran on one device: layers llama.cpp left on the
            # CPU beside a GPU (and the output layer) took kernels it did not see.
            split = engine.device != "CPU" and 0 <= engine.n_gpu_layers <= engine.n_layer
            # Nor repacked weights: it multiplies plain ones.
            split = split or kernels.extra_buffers
            if verdict.partial and ops.complete and not split:
                log.info(
                    "the whole-model comparison reached position %d of %d in its time; past "
                    "it the per-op check vouches alone (each op at every width up to %d and "
                    "every KV length up to %d)",
                    verdict.horizon,
                    verdict.n_ctx,
                    ops.size,
                    engine.n_ctx,
                )
            elif verdict.partial:
                # Said as what it is: a check of the first positions, not of the context.
                log.warning(
                    "exactness beside other sequences was checked up to position %d of %d "
                    "only (the whole-model check's time ran out, and the per-op check %s): a "
                    "job past it may get other tokens beside others than alone; "
                    "PARKQ_MAX_SEQS=1 is exact at every position",
                    verdict.horizon,
                    verdict.n_ctx,
                    "did not see every kernel (layers left on the CPU, or repacked weights)"
                    if split
                    else "is not complete",
                )
        else:
            size, how = settings.max_seqs, "PARKQ_EXACT off: any width, not checked"
        engine.plan_batching(size)
        if settings.exact:
            exactness = f"up to {size} sequences per decode call, each as alone: {how}"
        log.info(
            "%d sequences; one decode call takes up to %d of them (the most for which "
            "these kernels give each sequence its logits alone; %s), split as timed: %s; "
            "%d stepping together make %.1fx the tokens per second of one",
            settings.max_seqs,
            size,
            how,
            engine.splits_described(),
            settings.max_seqs,
            engine.speedup(settings.max_seqs),
        )
    if not settings.exact:
        engine.plan_prefill(settings.max_seqs)
    elif prompts is not None:
        engine.plan_prefill(_prompt_width(engine, prompts, settings))
    if floors:
        log.info("prompt calls on the tiled product and attention at every size, decode "
                 "calls on the one-row ones; up to %d prompts per call%s", engine.max_prefill,
                 "" if engine.max_prefill > 1 or prompts is None
                 else " (the check refused more)")  # fmt: skip
    elif settings.exact and settings.max_seqs > 1:
        log.info("each prompt chunk in a call of its own (batched prompts are checked only "
                 "on a CPU with parkq's llama.cpp)")  # fmt: skip
    prefill = (f", up to {engine.max_prefill} prompts per call" if engine.max_prefill > 1
               else ", prompts one per call")  # fmt: skip
    attention = ", flash attention" if engine.flash_attn else ", no flash attention"
    # Which llama.cpp (patched or stock), its floor and attention.
    exactness += f" ({build_info().split(';', 1)[0]}{floor}{attention}{prefill})"
    # What decides the tokens (system_fingerprint): the build and the kernels it
    # runs, the chunking of prompts, and (only without exactness) the widths.
    mode = "exact" if settings.exact else f"inexact, {settings.max_seqs} per call"
    mode += f"; parkq {_parkq_version()}"  # its sampler, templates and tokenizing
    decides = (f"{build_info().split(';', 1)[0]}{floor}{attention}; n_batch "
               f"{settings.n_batch}; extra buffers {'on' if kernels.extra_buffers else 'off'}; "
               f"{mode}")  # fmt: skip
    identity = identify(
        model_name(settings), settings.model or "", engine, engine.n_ctx, settings.cache_dir,
        device=engine.device, exactness=exactness, kernels=decides,
    )  # fmt: skip
    name = settings.worker_name or default_worker_name()
    client = connect(
        settings.redis_url or "",
        store_key=settings.keys.store_id,
        health_check_interval=30,
        client_name=settings.keys.client_name(name),  # its liveness: see Worker
    )
    w = Worker(settings, engine, client, name=name, model=identity)
    signals = {"count": 0}

    def _stop(signum: int, frame: Any) -> None:
        # First signal: park the running job (within a step), sign off, exit.
        signals["count"] += 1
        if signals["count"] > 1:
            raise SystemExit(1)
        w.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    w.run()


def _prompt_width(engine: LlamaEngine, prompts: OpChoice, settings: Settings) -> int:
    """How many prompts one prefill call of an exact worker takes: what the op
    check of prompt calls certified (run only without repacked weights and on a
    build with no GPU backend to take wide passes), where it saw every kernel
    the engine runs (the whole context, no weights left out), and where the
    whole model agrees too (:func:`prompts_together`); else 1, and the log
    says why."""
    why = ""
    if prompts.size <= 1:
        why = f"the check of prompt calls refused it ({prompts.how})"
    elif not prompts.complete:
        why = f"the check of prompt calls did not cover everything ({prompts.how})"
    else:
        ok, how = prompts_together(engine, prompts.size, settings.cache_dir)
        if ok:
            log.info("prompts together on the whole model: %s", how)
            return prompts.size
        why = f"the whole model differed: {how}"
    log.warning("each prompt prefilled in a call of its own: %s", why)
    return 1


def _parkq_version() -> str:
    try:
        return metadata.version("parkq")
    except metadata.PackageNotFoundError:
        return "source"
