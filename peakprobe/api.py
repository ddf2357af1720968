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


def _model_config(seq, config):
    """The config of the first selected checkpoint (small; read before any weights load)."""
    from transformers import AutoConfig

    from .data import DataError

    first = list(seq)[0]
    where = first.path or seq.source
    try:
        return AutoConfig.from_pretrained(where, revision=None if first.path else first.revision,
                                          trust_remote_code=config.trust_remote_code)
    except Exception as exc:
        raise DataError(f"cannot read the model config of {where} ({type(exc).__name__})") from exc


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
    window: int | None = None,
    text_field: str = "text",
    layout: str = "document",
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
    from .data import load_eval_data, window_for
    from .sweep import SweepConfig, SweepSummary, build_manifest, prepare_run_dir
    from .sweep import sweep as run_sweep

    seq = index(source, n=n, spacing=spacing, steps=steps, step_range=step_range, revisions=revisions)
    if any(c.path is None for c in seq):  # hub revisions: fail fast when the hub is unreachable
        from .checkpoints_index import check_hub_reachable

        check_hub_reachable(seq.source)
    config = config or SweepConfig()
    window = window_for(_model_config(seq, config), window)
    tok = load_tokenizer(seq, tokenizer)
    eval_data = load_eval_data(data, tok, n_windows=n_windows, window=window,
                               text_field=text_field, layout=layout)
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


def demo(out: str | os.PathLike = "peakprobe-demo", *, quick: bool = False, progress: bool = True,
         command: str | None = None) -> RunResult:
    """Train (or reuse) the embedded tiny Pythia-style run, then sweep, fit and report it."""
    from .hooks import ProbeConfig
    from .sweep import SweepConfig
    from .toy.tiny_lm import TinyLMConfig, train_tiny_lm

    out = Path(out)
    # quick: the test-sized model, with enough checkpoints past warmup for the loss fit.
    cfg = replace(TinyLMConfig.quick(), n_checkpoints=12, warmup_steps=2) if quick else TinyLMConfig()
    checkpoints = train_tiny_lm(out / "tiny-pythia", cfg, progress=progress)
    sweep_cfg = SweepConfig(batch_size=8, probe=ProbeConfig(sensitivity=True))
    n_windows = 16 if quick else 32
    return run(
        str(checkpoints), out / "run", data="embedded", n_windows=n_windows, window=cfg.seq_len,
        config=sweep_cfg, force=False, progress=progress, command=command,
        fit_kwargs={"progress": progress},
    )


def planted(out: str | os.PathLike, task: str, *, quick: bool = False, seed: int = 0,
            steps: int | None = None, progress: bool = True, command: str | None = None) -> RunResult:
    """Train (or reuse) a planted-bottleneck run (``peakprobe.toy.planted``), then sweep, fit and
    report it: ``OUT/checkpoints/``, ``OUT/eval.jsonl``, ``OUT/run/``."""
    from .hooks import ProbeConfig
    from .sweep import SweepConfig
    from .toy.planted import PlantedConfig, train_planted, write_eval_jsonl

    out = Path(out)
    cfg = PlantedConfig.quick(task) if quick else PlantedConfig.for_task(task)
    model = replace(cfg.model, seed=seed, **({"steps": steps} if steps is not None else {}))
    cfg = replace(cfg, model=model)
    checkpoints = train_planted(out / "checkpoints", cfg, progress=progress)
    n_windows = 16 if quick else 64
    data = write_eval_jsonl(out / "eval.jsonl", cfg, n_seqs=n_windows)
    return run(
        str(checkpoints), out / "run", data=str(data), n_windows=n_windows, window=cfg.seq_len,
        config=SweepConfig(batch_size=16, probe=ProbeConfig(sensitivity=True)), force=False,
        progress=progress, command=command, fit_kwargs={"progress": progress},
    )
