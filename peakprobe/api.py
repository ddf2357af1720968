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


# -- compare and fit_curve: families of runs, external loss curves -------------------------------
@dataclass
class FitCurveResult:
    """What ``fit_curve`` produced: the fits of every model, their table, the report's paths."""

    result: Any  # peakprobe.fits.curve.CurveResult
    table: Any  # pandas DataFrame, one row per fitted model (also written as fits.csv)
    report: Any  # peakprobe.reports.compare.ComparePaths


def _load_schedule(schedule):
    if schedule is None or not isinstance(schedule, (str, os.PathLike)):
        return schedule
    import json

    from .checkpoints_index import schedule_from_json

    path = Path(schedule)
    if not path.is_file():
        raise FileNotFoundError(f"schedule file {path} does not exist")
    try:
        obj = json.loads(path.read_text())
    except ValueError:
        raise ValueError(f"{path}: not valid JSON") from None
    return schedule_from_json(obj)


def _fit_external(path, *, metric=None, task=None, model=None, allow_metric=False, family=None,
                  schedule=None, n_params=None, t_min_step=512, t_max_step=None, band=None,
                  n_boot=1000, seed=0, scan=True):
    from .fits.curve import fit_curve_models
    from .fits.curve_io import read_curve
    from .vocab import BAND

    curve = read_curve(path, metric=metric, task=task, model=model, allow_metric=allow_metric)
    return fit_curve_models(curve, family=family, schedule=_load_schedule(schedule),
                            n_params=n_params, t_min_step=t_min_step, t_max_step=t_max_step,
                            band=band or BAND, n_boot=n_boot, seed=seed, scan=scan)


def fit_curve(path: str | os.PathLike, *, out: str | os.PathLike | None = None,
              command: str | None = None, **kwargs) -> FitCurveResult:
    """The loss-law fit, 1/3 verdict and window scan of an external curve, and its report.

    ``path``: a CSV / JSON / JSONL table or a folder of lm-eval result JSONs. Keyword options:
    ``metric, task, model, allow_metric, family, schedule`` (a schedule.json path or object),
    ``n_params, t_min_step`` (default 512), ``t_max_step, band, n_boot, seed, scan``.
    ``out`` (default ``<stem>-curve``) receives the comparison report of every model in the
    file plus ``fits.csv``.
    """
    from .fits.curve import fits_table
    from .reports.compare import compare_report, members_from_curves
    from .results import write_bytes

    result = _fit_external(path, **kwargs)
    out = Path(out) if out is not None else Path(f"{Path(path).stem}-curve")
    table = fits_table(result)
    paths = compare_report(members_from_curves(result), out, band=result.band, command=command,
                           failed=result.failed, title=f"peakprobe fit-curve: {Path(path).name}")
    write_bytes(out / "fits.csv", table.to_csv(index=False, lineterminator="\n").encode())
    return FitCurveResult(result, table, paths)


def compare(sources, out: str | os.PathLike, *, band: tuple[float, float] | None = None,
            n_boot: int = 1000, seed: int = 0, scan: bool = True, command: str | None = None,
            curve_kwargs: dict | None = None):
    """One comparison report over ``sources``: fitted run directories (with manifest.json) and
    external curve files or lm-eval folders (fitted here with ``curve_kwargs``; every model of
    a file is a member). Returns :class:`peakprobe.reports.compare.ComparePaths`."""
    from .reports.compare import compare_report, member_from_run, members_from_curves
    from .results import MANIFEST
    from .vocab import BAND

    band = band or BAND
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    members, failed = [], {}
    for src in sources:
        src = Path(src)
        if (src / MANIFEST).exists():
            members.append(member_from_run(src, band=band, n_boot=n_boot, seed=seed, scan=scan))
        else:
            res = _fit_external(src, band=band, n_boot=n_boot, seed=seed, scan=scan,
                                **(curve_kwargs or {}))
            members += members_from_curves(res)
            failed.update(res.failed)
    return compare_report(members, out, band=band, command=command, failed=failed)
