"""The `parkq` command."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from scheduler.settings import Settings, cache_root, data_root, load_settings
from tools.checks import preflight, redact, resolve_model, warn_if_open
from tools.logs import configure_logging

log = logging.getLogger(__name__)

__all__ = ["main"]


def _quiet() -> str | None:
    """The log level of the commands that print their own report (demo, bench,
    batch, soak): WARNING, so the stack's INFO lines do not bury it, unless
    PARKQ_LOG_LEVEL says otherwise (None: the setting's own)."""
    return None if os.environ.get("PARKQ_LOG_LEVEL") else "WARNING"


def _stop_on_signals(handler: Any) -> None:
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`parkq --version`: parkq's and the llama-cpp-python it runs (a job's
    tokens depend on the latter: the CHANGELOG says when an upgrade changes them)."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        engine = version("llama_cpp_python")
    except PackageNotFoundError:
        engine = "not installed"
    click.echo(f"parkq {version('parkq')} (llama-cpp-python {engine})")
    ctx.exit()


class _Commands(click.Group):
    """parkq's commands: a setting the environment gives wrong is one line
    naming it (PARKQ_<NAME>: what is wrong), not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from pydantic import ValidationError

        try:
            return super().invoke(ctx)
        except ValidationError as exc:
            said = "; ".join(
                f"PARKQ_{str(e['loc'][0]).upper()}: {e['msg']}" if e["loc"] else e["msg"]
                for e in exc.errors()
            )
            raise click.ClickException(said) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show parkq's version and llama-cpp-python's, and exit.")  # fmt: skip
def main() -> None:
    """parkq: interactive LLM requests never wait behind long jobs."""


_model_opt = click.option("--model", help="GGUF model path (default: the demo model).")
_redis_opt = click.option("--redis-url", help="Redis URL (env PARKQ_REDIS_URL).")
_host_opt = click.option("--host", help="Bind address [127.0.0.1].")
_port_opt = click.option("--port", type=int, help="Port [8000].")
_preempt_opt = click.option(
    "--no-preempt",
    "no_preempt",
    is_flag=True,
    help="Never interrupt a running job (priority order only), for A/B comparison.",
)


@main.command()
@_model_opt
@_host_opt
@_port_opt
@click.option("--workers", default="1", show_default=True,
              help="Worker processes, or 'per-gpu': one per NVIDIA GPU (nvidia-smi -L), "
                   "each seeing only its own (CUDA_VISIBLE_DEVICES) and sized on it.")  # fmt: skip
@_redis_opt
@click.option("--chat-format", help="Named chat format (default: the model's template).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The embedded Redis's data, kept across restarts (env PARKQ_DATA_DIR) "
                   "[~/.local/share/parkq].")  # fmt: skip
@click.option("--ephemeral", is_flag=True,
              help="Keep nothing: the embedded Redis lives in a temporary directory.")  # fmt: skip
@_preempt_opt
def up(model: str | None, host: str | None, port: int | None, workers: str,
       redis_url: str | None, chat_format: str | None, data_dir: Path | None,
       ephemeral: bool, no_preempt: bool) -> None:  # fmt: skip
    """Start Redis (embedded unless --redis-url), the web server and the workers.

    The embedded Redis keeps its data in --data-dir: jobs queued, parked or
    running at a stop (or a crash) resume after the next start, and clients
    continue their streams with Last-Event-ID.
    """
    from tools.launcher import Stack

    settings = load_settings(
        model=model,
        host=host,
        port=port,
        redis_url=redis_url,
        chat_format=chat_format,
        data_dir=str(data_dir) if data_dir else None,
        preempt=False if no_preempt else None,
    )
    configure_logging(settings.log_level, settings.log_format)
    settings = resolve_model(settings)
    preflight(settings)
    if ephemeral and data_dir:
        raise click.UsageError("--ephemeral keeps nothing: leave out --data-dir")
    warn_if_open(settings)
    gpus = _worker_gpus(workers)
    count = len(gpus) if gpus is not None else int(workers)
    if gpus is None:
        settings = with_sequences(settings, count)
    else:
        click.echo(f"parkq: one worker per GPU ({', '.join(gpus)}), each sizing its sequences "
                   "on its own", err=True)  # fmt: skip
    keep = None if ephemeral or settings.redis_url else data_root(settings.data_dir)
    stack = Stack(settings, workers=count, data_dir=keep, gpus=gpus)

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    _stop_on_signals(_terminate)
    code = 0
    try:
        stack.start()
        stack.wait_healthy()
        s = stack.settings
        redis_shown = redact(s.redis_url) + (f", data in {keep}" if keep else "")
        seqs = f" of {s.max_seqs} sequences" if s.max_seqs and s.max_seqs > 1 else ""
        click.echo(
            f"parkq is up at {stack.base_url}  (model {Path(s.model or '').name}, "
            f"{count} worker{'s' if count != 1 else ''}{seqs}, redis {redis_shown})"
        )
        code = stack.wait()
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        click.echo(f"parkq: {exc}", err=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
    sys.exit(code)


#: What `parkq bench` imports from the [bench] extra: the figure, and
#: llama-cpp-python's own server as a peer.
BENCH_MODULES = ("matplotlib", "fastapi", "uvicorn", "sse_starlette", "starlette_context")


def _need_bench_extra() -> None:
    """Say at once, not after a run of minutes, that the [bench] extra is missing."""
    from importlib.util import find_spec

    missing = [name for name in BENCH_MODULES if find_spec(name) is None]
    if missing:
        raise click.ClickException(
            f"parkq bench needs the [bench] extra ({', '.join(missing)} missing): "
            ".venv/bin/pip install -e '.[bench]' (./scripts/test installs it)"
        )


def _worker_gpus(workers: str) -> list[str] | None:
    """``--workers``: None for a number of workers; for ``per-gpu``, the GPUs to
    pin one worker each to (CUDA_VISIBLE_DEVICES's list where it is set, else
    every GPU ``nvidia-smi -L`` lists)."""
    if workers != "per-gpu":
        if not workers.isdecimal():
            raise click.BadParameter("a number of workers (0: none, the web alone), or "
                                     "'per-gpu'", param_hint="--workers")  # fmt: skip
        return None
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        ids = [x.strip() for x in given.split(",") if x.strip()]
    else:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        listed = ""
        if smi:
            try:
                run = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30,
                                     check=False)  # fmt: skip
                listed = run.stdout if run.returncode == 0 else ""
            except (subprocess.TimeoutExpired, OSError):
                listed = ""
        ids = [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
    if not ids:
        raise click.ClickException(
            "--workers per-gpu: no NVIDIA GPU found (nvidia-smi -L lists none, or "
            "CUDA_VISIBLE_DEVICES is empty); give a number of workers"
        )
    return ids


def with_sequences(settings: Settings, workers: int) -> Settings:
    """``settings`` with the sequences per worker decided (jobs/engine/capacity.py), said
    in one line: how many, and why."""
    from jobs.engine.capacity import sequence_plan_elsewhere

    try:
        plan = sequence_plan_elsewhere(settings, workers)
    except (RuntimeError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot plan the sequences ({exc})") from None
    parked = f", {plan.parked_seqs} more keep parked jobs in place" if plan.parked_seqs else ""
    click.echo(
        f"parkq: {plan.max_seqs} sequence{'s' if plan.max_seqs != 1 else ''} per worker "
        f"generate at once{parked} ({plan.reason})",
        err=True,  # standard output's first line stays the "parkq is up at" one
    )
    return settings.model_copy(update={"max_seqs": plan.max_seqs, "parked_seqs": plan.parked_seqs})


#: What hides a GPU from the CUDA and ROCm runtimes (an empty list: none visible).
GPU_VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def hide_gpus() -> None:
    """Make this process see no CUDA or ROCm GPU. The web server only tokenizes, and it loads
    the vocabulary (its startup check) before gunicorn forks its worker: a GPU
    runtime initialized before a fork aborts the child at its first call (seen
    on CUDA: every web worker died by SIGABRT as it booted)."""
    for name in GPU_VISIBILITY:
        os.environ[name] = ""


@main.command()
@_host_opt
@_port_opt
@_redis_opt
@_model_opt
def web(host: str | None, port: int | None, redis_url: str | None, model: str | None) -> None:
    """Run the web server alone (it needs Redis and, for tokenizing, the model file)."""
    from tools.serve import serve

    hide_gpus()

    settings = resolve_model(load_settings(host=host, port=port, redis_url=redis_url, model=model))
    configure_logging(settings.log_level, settings.log_format)
    if not settings.redis_url:
        raise click.ClickException("--redis-url (or PARKQ_REDIS_URL) is required")
    preflight(settings)
    warn_if_open(settings)
    serve(settings)


@main.command()
@_redis_opt
@_model_opt
@click.option("--name", help="Worker name (default host.pid).")
@_preempt_opt
def worker(redis_url: str | None, model: str | None, name: str | None, no_preempt: bool) -> None:
    """Run one worker: loads the model once and generates several jobs at once
    (PARKQ_MAX_SEQS sequences), parking one for a better job when all are busy."""
    from tools.worker_process import run_worker

    settings = resolve_model(
        load_settings(
            redis_url=redis_url,
            model=model,
            worker_name=name,
            preempt=False if no_preempt else None,
        )
    )
    configure_logging(settings.log_level, settings.log_format)
    if not settings.redis_url:
        raise click.ClickException("--redis-url (or PARKQ_REDIS_URL) is required")
    preflight(settings)
    run_worker(settings)


@main.command("make-test-model")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed.")
@click.option("--quant", type=click.Choice(["f32", "q8_0", "q4_0"]), default="f32",
              show_default=True, help="Type of the weight matrices.")  # fmt: skip
def make_test_model(path: Path, seed: int, quant: str) -> None:
    """Write the tiny deterministic random-weight GGUF used by the tests."""
    from jobs.engine.testmodel import write_test_model

    write_test_model(path, seed, quant)
    click.echo(f"wrote {path} ({path.stat().st_size} bytes, seed {seed}, {quant})")


@main.command()
@_model_opt
@click.option("--prompt", default="The history of the printing press", show_default=True,
              help="Prompt of the long batch job.")  # fmt: skip
@click.option("--max-tokens", type=int,
              help="Length of the long batch job [sized to run about 10 s here].")  # fmt: skip
@click.option("--question", default="The capital of France is", show_default=True,
              help="The short interactive request.")  # fmt: skip
def demo(model: str | None, prompt: str, max_tokens: int | None, question: str) -> None:
    """Start parkq; stream a long job; a short question parks it; it resumes."""
    import threading

    from tools.demo import DemoFailed, run_demo
    from tools.launcher import Stack, exit_status

    settings = resolve_model(load_settings(model=model, port=0, log_level=_quiet()))
    configure_logging(settings.log_level, settings.log_format)
    preflight(settings)
    logs = cache_root(settings.cache_dir) / "demo-logs" / time.strftime("%Y%m%d-%H%M%S")
    seqs = "one worker"
    if settings.max_seqs is None:
        # One sequence: the question must park the long job, which is what the
        # demo shows. `parkq up` batches several by default (jobs/engine/capacity.py),
        # and a full engine parks the same way.
        settings = settings.model_copy(update={"max_seqs": 1})
        seqs = "one worker of one sequence, so that the question must park the long job"
    click.echo(f"parkq: starting (embedded Redis, web server, {seqs})...")
    t0 = time.monotonic()
    stack = Stack(settings, log_dir=logs)
    failure: list[BaseException] = []

    def _run() -> None:
        try:
            run_demo(stack.base_url, prompt, max_tokens, question, _write)
        except BaseException as exc:  # reported below, in one line
            failure.append(exc)

    try:
        with stack:
            click.echo(f"parkq is up at {stack.base_url} after {time.monotonic() - t0:.1f} s")
            thread = threading.Thread(target=_run, daemon=True)
            thread.start()
            while thread.is_alive():
                dead = stack.exited()
                if dead is not None:
                    name, code = dead
                    raise DemoFailed(f"the {name} process {exit_status(code)}; its log: "
                                     f"{stack.log_path(name)}")  # fmt: skip
                thread.join(timeout=0.2)
            if failure:
                raise failure[0]
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    except Exception as exc:
        reason = str(exc) if isinstance(exc, DemoFailed | RuntimeError) else repr(exc)
        click.echo(f"\nparkq demo failed: {reason} (logs in {logs})", err=True)
        raise click.exceptions.Exit(1) from None
    click.echo("parkq: stopped.")


@main.command()
@_model_opt
@click.option("--quick", is_flag=True, help="Tiny generated model, short run (under a minute).")
@click.option("--duration", type=float, help="Seconds per mode [60; quick 6].")
@click.option("--rate", type=float, help="Short requests per second (Poisson) [0.5; quick 2].")
@click.option("--short-tokens", type=int, help="Output tokens of a short request [32; quick 16].")
@click.option("--long-tokens", type=int, help="Output tokens of a long job [1024; quick 512].")
@click.option("--long-prompt-words", type=int, default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Folder for bench.json and bench.png.",
)
@click.option(
    "--peer-server",
    help="llama.cpp's llama-server binary, run as one more mode with as many slots as "
    "PARKQ_MAX_SEQS [the one `python -m tools.bench.llama_server build` cached, if any; "
    "'none' skips it].",
)
@click.option("--sampling", default="greedy,default", show_default=True,
              help="Sampling arms, each a full run of every mode: greedy, and default "
                   "(what the openai client sends unasked: temperature 1, top_p 1).")  # fmt: skip
def bench(model: str | None, quick: bool, duration: float | None, rate: float | None,
          short_tokens: int | None, long_tokens: int | None, long_prompt_words: int,
          seed: int, out: Path, peer_server: str | None, sampling: str) -> None:  # fmt: skip
    """Benchmark parkq against --no-preempt, llama_cpp.server, llama-server and an idle
    engine, greedy and with the openai client's default sampling."""
    import tempfile

    _need_bench_extra()
    from jobs.engine.llama import Vocab
    from jobs.engine.testmodel import write_test_model
    from tools.bench import SAMPLING
    from tools.bench.report import run_bench
    from tools.bench.workload import Workload

    if quick and model is None:
        model = str(write_test_model(Path(tempfile.mkdtemp()) / "tiny.gguf"))
    settings = resolve_model(load_settings(model=model, port=0, log_level=_quiet()))
    configure_logging(settings.log_level, settings.log_format)
    settings = with_sequences(settings, 1)
    workload = Workload(
        duration=duration or (6.0 if quick else 60.0),
        short_rate=rate or (2.0 if quick else 0.5),
        short_tokens=short_tokens or (16 if quick else 32),
        long_tokens=long_tokens or (512 if quick else 1024),
        long_prompt_words=long_prompt_words,
        seed=seed,
    )
    vocab = Vocab(settings.model or "", settings.chat_format)
    eos = sorted({t for t in (vocab.eos, *_eog_ids(vocab)) if t >= 0})
    if peer_server is None:
        from tools.bench.llama_server import llama_server_path

        cached = llama_server_path(settings.cache_dir)
        peer_server = str(cached) if cached.exists() else None
    elif peer_server == "none":
        peer_server = None
    arms = tuple(a for a in sampling.split(",") if a)
    if unknown := [a for a in arms if a not in SAMPLING]:
        raise click.UsageError(f"--sampling takes {', '.join(SAMPLING)}, not {', '.join(unknown)}")
    run_bench(settings, workload, eos, out, click.echo, peer_server, arms)


@main.command("batch")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--prompt", help="The instruction applied to every document.")
@click.option("--task", type=click.Choice(["summarize"]), help="A built-in instruction.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("results.jsonl"), show_default=True,
              help="JSONL results, one line per document (also what a rerun skips).")  # fmt: skip
@click.option("--url", help="A running parkq (default: start one here).")
@click.option("--api-key", envvar="PARKQ_API_KEY", help="Key for --url (env PARKQ_API_KEY).")
@_model_opt
@click.option("--max-tokens", type=int, default=256, show_default=True,
              help="Answer length of each request.")  # fmt: skip
@click.option("--overlap", type=int, default=64, show_default=True,
              help="Tokens shared by consecutive parts of a long document.")  # fmt: skip
@click.option("--parallel", type=int, default=4, show_default=True,
              help="Documents in flight at once.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--schema", "schema_file", type=click.Path(dir_okay=False, path_type=Path),
              help="A JSON schema file: every answer is JSON that follows it, and each "
              "document's result is that object.")  # fmt: skip
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def batch(paths: tuple[Path, ...], prompt: str | None, task: str | None, out: Path,
          url: str | None, api_key: str | None, model: str | None, max_tokens: int,
          overlap: int, parallel: int, seed: int, temperature: float,
          schema_file: Path | None, no_progress: bool) -> None:  # fmt: skip
    """Process text and Markdown documents (files or folders) at batch priority.

    Long documents are split into overlapping token windows; the partial results
    are combined into one per document. Results already in --out are kept and
    their documents skipped. Exits 1 and lists the failures if any document failed.
    """
    from tools.documents import (
        SUFFIXES,
        SUMMARIZE,
        Client,
        DocumentError,
        Task,
        collect,
        run_batch,
    )

    if prompt and task:
        raise click.UsageError("give --prompt or --task, not both")
    schema = None
    if schema_file is not None:
        from jobs.engine.constraints import grammar_for_json_schema

        try:
            schema = json.loads(schema_file.read_text(encoding="utf-8"))
            grammar_for_json_schema(schema)  # refused here, not once per document
        except (OSError, ValueError) as exc:  # GrammarError is a ValueError
            raise click.ClickException(f"--schema {schema_file}: {exc}") from None
    spec = Task(
        instruction=prompt or SUMMARIZE,
        max_tokens=max_tokens,
        overlap=overlap,
        temperature=temperature,
        seed=seed,
        schema=schema,
    )
    try:
        docs = collect(paths)
    except DocumentError as exc:
        raise click.ClickException(str(exc)) from None
    if not docs:
        raise click.ClickException(f"no documents found (looked for {', '.join(SUFFIXES)})")

    def go(base_url: str, key: str | None) -> Any:
        return run_batch(
            Client(base_url, key), docs, spec, out, parallel, None if no_progress else _bar
        )

    if url:
        summary = go(url, api_key)
    else:
        from tools.launcher import Stack

        settings = resolve_model(load_settings(model=model, port=0, log_level=_quiet()))
        configure_logging(settings.log_level, settings.log_format)
        click.echo("parkq: starting (embedded Redis, web server, one worker)...", err=True)
        with Stack(settings) as stack:
            keys = stack.settings.api_key_list
            summary = go(stack.base_url, keys[0] if keys else None)
    rate = summary.completion_tokens / summary.seconds if summary.seconds else 0.0
    click.echo(
        f"parkq batch: {summary.completed} done, {summary.skipped} already done, "
        f"{len(summary.failures)} failed of {summary.documents} documents in "
        f"{summary.seconds:.1f} s ({summary.completion_tokens} tokens, {rate:.1f} tok/s"
        + (f", {summary.preemptions} preemptions" if summary.preemptions is not None else "")
        + f"); results in {out}",
        err=True,
    )
    if summary.failures:
        for path, why in summary.failures:
            click.echo(f"  failed: {path}: {why}", err=True)
        sys.exit(1)


def _bar(total: int, skipped: int) -> Any:
    """A tqdm bar: documents done, tokens per second, ETA."""
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI).
    bar = tqdm(total=total, unit="doc", desc="documents", dynamic_ncols=True, disable=None)
    start = time.monotonic()

    def update(ended: int, tokens: int) -> None:
        bar.update(ended - bar.n)
        rate = tokens / max(1e-6, time.monotonic() - start)
        bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=True)
        if ended >= total:
            bar.close()

    if total == 0:
        bar.close()
    return update


@main.command()
@click.option("--duration", default="10m", show_default=True, help="How long: 90s, 10m, 1h.")
@click.option("--url", help="A running parkq (default: start one here).")
@click.option("--api-key", envvar="PARKQ_API_KEY", help="Key for --url (env PARKQ_API_KEY).")
@_model_opt
@click.option("--tiny", is_flag=True, help="Use the tiny generated test model (fast, for CI).")
@click.option("--workers", type=int, default=1, show_default=True, help="Workers to start.")
@click.option("--rate", type=float,
              help="Interactive requests per second (Poisson) [0.1; --tiny 2].")  # fmt: skip
@click.option("--batch-clients", type=int, default=2, show_default=True,
              help="Clients each keeping one batch job running.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as JSON here.")  # fmt: skip
def soak(duration: str, url: str | None, api_key: str | None, model: str | None,
         tiny: bool, workers: int, rate: float | None, batch_clients: int, seed: int,
         out: Path | None) -> None:  # fmt: skip
    """Run a mixed workload for a while; exit 1 on any unexpected error or lost job.

    Interactive and batch requests (greedy, drawn from a small set, so a
    repeated request must give the same text), cancellations, readers that
    reconnect with Last-Event-ID, and the preemptions all this causes. A run
    that went through no preemption, no reconnect or no interactive completion
    proves little: it says so and exits 2.
    """
    import json
    import tempfile

    from tools.soak import SoakPlan, parse_duration, run_soak

    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--duration") from None
    # The tiny model is ~100x faster: longer batch jobs keep preemption frequent.
    lengths = {"interactive_tokens": (8, 16, 24), "batch_tokens": (200, 400, 600)} if tiny else {}
    plan = SoakPlan(
        duration=seconds,
        interactive_rate=rate if rate is not None else 2.0 if tiny else 0.1,
        batch_clients=batch_clients,
        seed=seed,
        **lengths,  # type: ignore[arg-type]
    )
    if url:
        report = run_soak(url.rstrip("/"), plan, api_key, click.echo)
    else:
        from tools.launcher import Stack

        if tiny and model is None:
            from jobs.engine.testmodel import write_test_model

            model = str(write_test_model(Path(tempfile.mkdtemp()) / "tiny.gguf"))
        settings = resolve_model(load_settings(model=model, port=0, log_level=_quiet()))
        configure_logging(settings.log_level, settings.log_format)
        if settings.max_seqs is None:
            # As many sequences as batch clients: the batch jobs fill the engine,
            # so interactive requests must park one (batching and parking at once).
            settings = settings.model_copy(update={"max_seqs": max(1, batch_clients)})
        click.echo(
            f"parkq: starting a stack for a {duration} soak "
            f"({settings.max_seqs} sequence(s) per worker, {batch_clients} batch clients)..."
        )
        with Stack(settings, workers=workers) as stack:
            keys = stack.settings.api_key_list
            report = run_soak(stack.base_url, plan, keys[0] if keys else None, click.echo)
    for line in _soak_table(report):
        click.echo(line)
    if out:
        out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not report.ok:
        for message in report.errors:
            click.echo(f"  error: {message}", err=True)
        sys.exit(1)
    if report.unexercised:
        click.echo(
            f"parkq soak: inconclusive: {', '.join(report.unexercised)} "
            "(raise --rate or --duration)",
            err=True,
        )
        sys.exit(2)


def _soak_table(report: Any) -> list[str]:
    mib = 1024 * 1024

    def mem(value: int | None) -> str:
        return "n/a" if value is None else f"{value / mib:.0f} MiB"

    rows = [
        ("duration", f"{report.duration_s:.0f} s"),
        ("requests", report.requests),
        ("completions", report.completions),
        ("cancellations", report.cancellations),
        ("refused (429)", report.refused_429),
        ("reconnects", report.reconnects),
        ("preemptions", report.preemptions),
        ("tokens generated", report.tokens),
        ("lost jobs", report.lost),
        ("unexpected errors", report.unexpected_errors),
    ]
    for priority, q in report.ttft_ms.items():
        rows.append((f"TTFT {priority} p50 / p95", f"{q['p50']} / {q['p95']} ms (n={q['n']})"))
    rows.append(("worker memory start / end", f"{mem(report.worker_rss_start)} / "
                 f"{mem(report.worker_rss_end)}"))  # fmt: skip
    result = "FAILED" if not report.ok else "INCONCLUSIVE" if report.unexercised else "OK"
    rows.append(("result", result))
    return [f"{name:<28} {value}" for name, value in rows]


def _eog_ids(vocab: Any) -> list[int]:
    return [t for t in range(min(vocab.n_vocab, 300)) if vocab.is_eog(t)]


def _write(text: str) -> None:
    click.echo(text, nl=False)


if __name__ == "__main__":
    main()
