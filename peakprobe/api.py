"""The Python API behind the command line, for notebooks: index, sweep, fit, report, run, demo.

Every function here is what the matching ``peakprobe`` subcommand calls, with the same
defaults. Heavy imports (torch, transformers, matplotlib) happen inside the functions, so
``import peakprobe`` stays light and free of side effects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass
class RunResult:
    """What ``run`` produced: the sweep summary, the fits, and the report's paths."""

    run_dir: Path
    sweep: Any
    fits: Any
    report: Any


def index(
    source: str,
    *,
    n: int | None = None,
    spacing: str = "log",
    steps: list[int] | None = None,
    step_range: tuple[int, int] | None = None,
    revisions: list[str] | None = None,
):
    """The checkpoints of ``source`` (a family name, hub id or local run folder), optionally a subset."""
    from .checkpoints_index import resolve

    seq = resolve(source)
    if n is not None or steps or step_range or revisions:
        seq = seq.select(n=n, spacing=spacing, steps=steps, step_range=step_range, revisions=revisions)
    return seq


def load_tokenizer(seq, tokenizer: str | None = None):
    """The tokenizer named by ``tokenizer``, else the one saved with the last checkpoint."""
    from transformers import AutoTokenizer

    from .data import DataError

    last = list(seq)[-1]
    where = tokenizer or last.path or seq.source
    revision = None if (tokenizer or last.path) else last.revision
    try:
        return AutoTokenizer.from_pretrained(where, revision=revision)
    except Exception as exc:
        raise DataError(
            f"cannot load a tokenizer from {where} ({type(exc).__name__}); pass --tokenizer PATH "
            "to a local tokenizer folder"
        ) from exc


def _sweep_worker(payload: dict, rank: int, world: int):
    import torch

    from .sweep import sweep as run_sweep

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    show = payload.pop("progress") and rank == 0
    return run_sweep(rank=rank, world=world, progress=show, **payload)


def sweep(
    source: str,
    out: str | os.PathLike,
    *,
    data: str = "embedded",
    n_windows: int = 64,
    window: int = 256,
    text_field: str = "text",
    tokenizer: str | None = None,
    n: int | None = None,
    spacing: str = "log",
    steps: list[int] | None = None,
    step_range: tuple[int, int] | None = None,
    revisions: list[str] | None = None,
    config=None,
    processes: int = 1,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
):
    """Probe the selected checkpoints of ``source`` on fixed evaluation windows; write ``out``.

    ``config`` is a :class:`peakprobe.sweep.SweepConfig`; ``processes > 1`` splits the
    checkpoints over that many local processes (one GPU each when there are GPUs).
    """
    from .data import load_eval_data
    from .sweep import SweepConfig, SweepSummary, build_manifest, prepare_run_dir
    from .sweep import sweep as run_sweep

    seq = index(source, n=n, spacing=spacing, steps=steps, step_range=step_range, revisions=revisions)
    if any(c.path is None for c in seq):  # hub revisions: fail fast when the hub is unreachable
        from .checkpoints_index import check_hub_reachable

        check_hub_reachable(seq.source)
    config = config or SweepConfig()
    tok = load_tokenizer(seq, tokenizer)
    eval_data = load_eval_data(data, tok, n_windows=n_windows, window=window, text_field=text_field)
    kwargs = dict(seq=seq, data=eval_data, run_dir=Path(out), config=config, command=command)
    if processes <= 1:
        return run_sweep(force=force, progress=progress, **kwargs)

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    prepare_run_dir(Path(out), build_manifest(seq, eval_data, config, command), force=force)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        futures = [
            pool.submit(_sweep_worker, {**kwargs, "progress": progress}, rank, processes)
            for rank in range(processes)
        ]
        parts = [f.result() for f in futures]
    return SweepSummary(
        Path(out),
        [r for p in parts for r in p.done],
        [r for p in parts for r in p.skipped],
        [r for p in parts for r in p.failed],
    )


def fit(run_dir: str | os.PathLike, **kwargs):
    """Fit growth and loss laws of a swept run; writes ``fits.parquet`` and ``fits.json``."""
    from .fits import fit_run

    return fit_run(run_dir, **kwargs)


def report(run_dir: str | os.PathLike, **kwargs):
    """Render ``RUN/report/`` (HTML, tables, JSON, Markdown, figures) from a fitted run."""
    from .reports import render_report

    return render_report(run_dir, **kwargs)


def run(source: str, out: str | os.PathLike, *, fit_kwargs: dict | None = None, **sweep_kwargs) -> RunResult:
    """Sweep, fit and report in one call; returns what each stage produced."""
    summary = sweep(source, out, **sweep_kwargs)
    fits = fit(out, **(fit_kwargs or {}))
    paths = report(out, command=sweep_kwargs.get("command"))
    return RunResult(Path(out), summary, fits, paths)


#: evaluation windows of the full demo's live probes
DEMO_WINDOWS = 8


def demo(out: str | os.PathLike = "peakprobe-demo", *, quick: bool = False, progress: bool = True,
         command: str | None = None) -> RunResult:
    """Train (or reuse) the embedded tiny Pythia-style run with a live Monitor, then fit and report.

    The run directory ``OUT/run`` is written by the Monitor while the tiny LM trains (about
    ``vocab.MONITOR_POINTS`` probes, log-spaced after the warmup); the trainer still saves a
    few checkpoints in ``OUT/tiny-pythia`` that ``peakprobe sweep`` can probe again.
    """
    from .data import load_eval_data
    from .hooks import ProbeConfig
    from .integrations import Monitor
    from .sweep import SweepConfig
    from .toy import corpus
    from .toy.tiny_lm import TinyLMConfig, is_complete, train_tiny_lm

    out = Path(out)
    # quick: the test-sized model, warmup short enough that most probes fall in the fit window.
    cfg = replace(TinyLMConfig.quick(), n_checkpoints=4, warmup_steps=2) if quick else TinyLMConfig()
    tiny, run_dir = out / "tiny-pythia", out / "run"
    sweep_cfg = SweepConfig(batch_size=8, probe=ProbeConfig(sensitivity=True))
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, cfg.seq_len))
    # 8 windows x 256 tokens (2048 rows per head) keep 40 live probes near 10% of the training
    # time (benchmarks/monitor.py); the same windows at every step, so no noise between steps
    data = load_eval_data("embedded", tokenizer, n_windows=16 if quick else DEMO_WINDOWS,
                          window=cfg.seq_len)
    monitor = Monitor(
        data, run_dir, total_steps=cfg.steps, start=max(1, cfg.warmup_steps), config=sweep_cfg,
        name=tiny.name, source=str(tiny.resolve()), schedule=cfg.schedule(), lr_max=cfg.lr_max,
        command=command,
    )
    if not (is_complete(tiny, cfg) and monitor.is_complete()):
        monitor.force = True  # the training starts over, so does its run directory
        with monitor:
            train_tiny_lm(tiny, cfg, progress=progress, on_step=monitor.on_step, retrain=True)
    fits = fit(run_dir, progress=progress)
    paths = report(run_dir, command=command)
    return RunResult(run_dir, monitor.summary(), fits, paths)
