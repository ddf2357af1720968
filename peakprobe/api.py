"""The Python API behind the command line, for notebooks: index, sweep, fit, report, run, demo.

Every function here is what the matching ``peakprobe`` subcommand calls, with the same
defaults. Heavy imports (torch, transformers, matplotlib) happen inside the functions, so
``import peakprobe`` stays light and free of side effects.
"""

from __future__ import annotations

import os
import warnings
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


def _note(text: str) -> None:
    """A one-line notice about the selection or the schedule: a PeakprobeWarning, which the CLI
    prints as ``peakprobe: warning: ...`` (hidden by -q) and notebooks show as a warning."""
    from .checkpoints_index import CheckpointIndexWarning

    warnings.warn(text, CheckpointIndexWarning, stacklevel=3)


def _resolve(source: str, schedule: str | None):
    from .checkpoints_index import read_schedule_file, resolve, with_schedule

    seq = resolve(source)
    return seq if schedule is None else with_schedule(seq, read_schedule_file(schedule))


def _available(seq, *, check_hub: bool):
    """(available sequence, where-words, offline) for ``seq``: the HF cache when offline or when
    the hub is unreachable and the cache holds some revisions; else everything."""
    from .checkpoints_index import (
        OfflineError,
        cached_refs,
        check_hub_reachable,
        offline_requested,
        restrict_to_cache,
    )

    if all(c.path is not None for c in seq):
        return seq, "available", False
    offline = offline_requested()
    if not offline and check_hub:
        try:
            check_hub_reachable(seq.source)
        except OfflineError:
            if not cached_refs(seq.source):
                raise
            _note(f"the hub is unreachable: using the revisions of {seq.source} in the HF cache")
            offline = True
    if offline:
        cached = restrict_to_cache(seq)
        if len(cached) or check_hub:
            return cached, "in the HF cache", True
        return seq, "available", True  # `index` offline with nothing cached: the built-in table
    return seq, "on the hub", False


def index(
    source: str,
    *,
    n: int | None = None,
    spacing: str = "log",
    steps: list[int] | None = None,
    step_range: tuple[int, int] | None = None,
    revisions: list[str] | None = None,
    schedule: str | None = None,
):
    """The checkpoints of ``source`` (a family name, hub id or local run folder), optionally a
    subset; offline, the revisions held in the HF cache. ``schedule`` is a schedule file (JSON,
    CSV or trainer_state.json) that gives tau."""
    from .checkpoints_index import Selection

    full = _resolve(source, schedule)
    available, where, offline = _available(full, check_hub=False)
    selection = Selection(n, spacing, steps, step_range, revisions)
    if selection.empty:
        return available
    return _select(full, available, where, offline, selection)


def _select(full, available, where: str, offline: bool, selection):
    """``select_available`` with its note said (one line on stderr)."""
    from .checkpoints_index import select_available

    seq, note = select_available(full, available, where=where, selection=selection,
                                 complete=not offline or full.family == "pythia")
    if note:
        _note(note)
    return seq


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
    schedule: str | None = None,
    config=None,
    processes: int = 1,
    shard: tuple[int, int] | str | None = None,
    prune_cache: bool = False,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
):
    """Probe the selected checkpoints of ``source`` on fixed evaluation windows; write ``out``.

    ``config`` is a :class:`peakprobe.sweep.SweepConfig`. Hub revisions come from the HF cache
    when offline (``HF_HUB_OFFLINE=1``) or when the hub is unreachable; the selection is made
    among the available revisions, with one line on what is missing. With no selection, Pythia
    gets the authors' 13 steps plus log-spaced fill (16). ``processes``, ``shard`` (``(K, N)`` or
    ``"K/N"``) and ``prune_cache`` are those of :func:`peakprobe.sweep.sweep`.
    """
    from dataclasses import replace as _replace

    from .checkpoints_index import Selection
    from .data import DataError, load_eval_data, window_for
    from .sweep import SweepConfig, SweepError, load_config, load_tokenizer, parse_shard
    from .sweep import sweep as run_sweep

    if isinstance(shard, str):
        shard = parse_shard(shard)
    if shard is not None and force:  # checked before anything is read or said
        raise SweepError("--force with --shard would discard the other shards' results; "
                         "remove the run directory first instead")
    full = _resolve(source, schedule)
    hub = any(c.path is None for c in full)
    if hub and data == "embedded":
        raise DataError(
            f"--data embedded is the demo's synthetic corpus and means nothing to {full.source}: "
            "give real text with --data FILE.txt|FILE.jsonl or --data hf:NAME[:CONFIG]:SPLIT"
        )
    available, where, offline = _available(full, check_hub=True)
    seq = _select(full, available, where, offline, Selection(n, spacing, steps, step_range, revisions))
    unknown = [c.revision for c in seq if c.tau is None]
    if unknown:
        _note(f"tau is unknown for {len(unknown)} of {len(seq)} checkpoints of {seq.name} "
                        "(no learning-rate schedule): the fits use steps; give --schedule FILE to fix")
    config = config or SweepConfig()
    if offline:
        config = _replace(config, local_files_only=True)
    first = seq[0]
    window = window_for(load_config(first.path or seq.source, first.revision, config), window)
    tok = load_tokenizer(seq, tokenizer, local_files_only=config.local_files_only)
    eval_data = load_eval_data(data, tok, n_windows=n_windows, window=window,
                               text_field=text_field, layout=layout)
    return run_sweep(seq, eval_data, Path(out), config, force=force, processes=processes,
                     shard=shard, prune_cache=prune_cache, progress=progress, command=command)


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
    from . import corpus
    from .data import load_eval_data
    from .integrations import Monitor, live_config
    from .toy.tiny_lm import TinyLMConfig, is_complete, train_tiny_lm

    out = Path(out)
    # quick: the test-sized model, warmup short enough that most probes fall in the fit window.
    cfg = replace(TinyLMConfig.quick(), n_checkpoints=4, warmup_steps=2) if quick else TinyLMConfig()
    tiny, run_dir = out / "tiny-pythia", out / "run"
    sweep_cfg = replace(live_config(), batch_size=8)
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, cfg.seq_len))
    # statistics on 8 windows x 256 tokens (2048 rows per head) at 40 probes, the attribution at 8
    # of them on 2 windows (live_config): under 10% of the training time (benchmarks/monitor.py);
    # the same windows at every step, so no sampling noise between steps
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
