"""The Python API behind the command line, for notebooks and scripts.

Every function here is what the matching ``peakprobe`` subcommand calls, with the same defaults
(the configuration records of ``peakprobe.config``); each returns a typed record. Heavy imports
(torch, transformers, matplotlib) happen inside the functions, so ``import peakprobe`` stays
light and free of side effects.

A local run folder (``step<N>/`` or ``checkpoint-<N>/`` save_pretrained folders) end to end::

    import peakprobe
    from peakprobe.config import DataConfig, FitConfig

    result = peakprobe.run("./my-run", "runs/mine", data=DataConfig(data="eval.txt"))
    print(result.fits.verdict["bottleneck"]["verdict"])   # attention, lm_head, none, undetermined
    print(result.report.html)                             # runs/mine/report/report.html

or stage by stage (each reads only what the one before wrote)::

    outcome = peakprobe.sweep("pythia-160m", "runs/p160m", data=DataConfig(data="eval.jsonl"))
    fits = peakprobe.fit("runs/p160m", FitConfig(t_min_step=1000))
    paths = peakprobe.report("runs/p160m")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .config import AttributionConfig, CurveConfig, DataConfig, FitConfig, SweepConfig

if TYPE_CHECKING:  # the records the functions return; imported lazily at run time
    import pandas as pd

    from .checkpoints_index import CheckpointSequence, Selection
    from .fits import RunFits
    from .fits.curve import CurveResult
    from .reports import ReportPaths
    from .reports.compare import ComparePaths
    from .sweep import SweepOutcome


@dataclass
class RunResult:
    """What ``run``, ``demo`` and ``planted`` produced: the run directory, the sweep's outcome
    (or the live run's), the fits and the report's files."""

    run_dir: Path
    sweep: SweepOutcome
    fits: RunFits
    report: ReportPaths


@dataclass
class FitCurveResult:
    """What ``fit_curve`` produced: the fits of every model, their table, the report's paths."""

    result: CurveResult
    table: pd.DataFrame  # one row per fitted model (also written as fits.csv)
    report: ComparePaths


@dataclass
class ToyResult:
    """What a toy run wrote: its folder, the ``toy.json`` document, and the text the command
    line prints (every fitted exponent with its interval and verdict)."""

    out_dir: Path
    document: dict
    text: str


def _resolve(source: str, schedule: str | None) -> CheckpointSequence:
    from .checkpoints_index import read_schedule_file, resolve, with_schedule

    seq = resolve(source)
    return seq if schedule is None else with_schedule(seq, read_schedule_file(schedule))


def _select(full, found, selection) -> CheckpointSequence:
    """``select_available`` among what ``available`` found, its note said as a warning."""
    import warnings

    from .checkpoints_index import CheckpointIndexWarning, select_available

    seq, note = select_available(full, found.seq, where=found.where, selection=selection,
                                 complete=not found.offline or full.family == "pythia")
    if note:
        warnings.warn(note, CheckpointIndexWarning, stacklevel=3)
    return seq


def index(source: str, *, selection: Selection | None = None, schedule: str | None = None
          ) -> CheckpointSequence:
    """The checkpoints of ``source`` (a family name, hub id or local run folder), optionally a
    subset; offline, the revisions held in the HF cache. ``schedule`` is a schedule file (JSON,
    CSV or trainer_state.json) that gives tau.

    A local run needs only each checkpoint's ``config.json`` to be listed:

    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> for step in (0, 100, 1000, 10000):
    ...     (folder / f"step{step}").mkdir()
    ...     _ = (folder / f"step{step}" / "config.json").write_text("{}")
    >>> [c.step for c in index(str(folder))]
    [0, 100, 1000, 10000]
    >>> from peakprobe.checkpoints_index import Selection
    >>> [c.step for c in index(str(folder), selection=Selection(steps=[0, 1000]))]
    [0, 1000]
    """
    from .checkpoints_index import Selection, available

    full = _resolve(source, schedule)
    found = available(full, check_hub=False)
    selection = selection or Selection()
    return found.seq if selection.empty else _select(full, found, selection)



def probe(model_dir: str | os.PathLike, data: DataConfig | None = None, *,
          allow_pickle: bool = False, attribution: bool = False) -> pd.DataFrame:
    """Tidy per-site statistics (one row per site and metric) of the one checkpoint saved in
    ``model_dir``, over the windows ``data`` describes (default: 8 windows of the embedded
    corpus); ``attribution`` also runs the loss attribution. ``peakprobe probe`` prints it with
    ``probe_one.format_probe_table``.

    >>> import tempfile
    >>> from peakprobe.toy.tiny_lm import TinyLMConfig, train_tiny_lm
    >>> run = train_tiny_lm(tempfile.mkdtemp(), TinyLMConfig.quick(), progress=False)
    >>> frame = probe(run / "step60", DataConfig(n_windows=2, window=32))
    >>> sorted(frame["site_kind"].unique())
    ['attn', 'lm_head']
    >>> peaked = frame[frame["metric"] == "peaked_entropy"]
    >>> len(peaked), bool(peaked["value"].between(0, 1).all())
    (9, True)
    """
    from .probe_one import probe_folder

    return probe_folder(model_dir, data, allow_pickle=allow_pickle, attribution=attribution)

def sweep(
    source: str,
    out: str | os.PathLike,
    *,
    data: DataConfig | None = None,
    selection: Selection | None = None,
    schedule: str | None = None,
    config: SweepConfig | None = None,
    processes: int = 1,
    shard: tuple[int, int] | str | None = None,
    prune_cache: bool = False,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> SweepOutcome:
    """Probe the selected checkpoints of ``source`` on fixed evaluation windows; write ``out``.

    Hub revisions come from the HF cache when offline (``HF_HUB_OFFLINE=1``) or when the hub is
    unreachable; the selection is made among the available revisions, with one warning on what
    is missing. With no selection, Pythia gets the authors' 13 steps plus log-spaced fill (16).
    ``processes``, ``shard`` (``(K, N)`` or ``"K/N"``) and ``prune_cache`` are those of
    :func:`peakprobe.sweep.sweep`.
    """
    import warnings

    from .checkpoint import load_config, load_tokenizer
    from .checkpoints_index import CheckpointIndexWarning, Selection, available
    from .data import DataError, load_eval_data, window_for
    from .sweep import check_shard
    from .sweep import sweep as run_sweep

    data = data or DataConfig()
    shard = check_shard(shard, force)  # before anything is read or said
    full = _resolve(source, schedule)
    if any(c.path is None for c in full) and data.data == "embedded":
        raise DataError(
            f"--data embedded is the demo's synthetic corpus and means nothing to {full.source}: "
            "give real text with --data FILE.txt|FILE.jsonl or --data hf:NAME[:CONFIG]:SPLIT"
        )
    found = available(full, check_hub=True)
    seq = _select(full, found, selection or Selection())
    unknown = [c.revision for c in seq if c.tau is None]
    if unknown:
        warnings.warn(f"tau is unknown for {len(unknown)} of {len(seq)} checkpoints of {seq.name} "
                      "(no learning-rate schedule): the fits use steps; give --schedule FILE to fix",
                      CheckpointIndexWarning, stacklevel=2)
    config = config or SweepConfig()
    if found.offline:
        config = replace(config, local_files_only=True)
    first = seq[0]
    window = window_for(load_config(first.path or seq.source, first.revision, config), data.window)
    tok = load_tokenizer(seq, data.tokenizer, local_files_only=config.local_files_only)
    eval_data = load_eval_data(data.data, tok, n_windows=data.n_windows, window=window,
                               text_field=data.text_field, layout=data.layout)
    return run_sweep(seq, eval_data, Path(out), config, force=force, processes=processes,
                     shard=shard, prune_cache=prune_cache, progress=progress, command=command)


def fit(run_dir: str | os.PathLike, config: FitConfig | None = None, *, progress: bool = False) -> RunFits:
    """Fit growth and loss laws of a swept run; writes ``fits.parquet`` and ``fits.json``. A fit
    without enough points in its window is skipped and listed (``RunFits.skipped``); the others
    still run. (``run``'s example sweeps a run to fit.)
    """
    from .fits import fit_run

    return fit_run(run_dir, config or FitConfig(), progress=progress)


def report(run_dir: str | os.PathLike, *, command: str | None = None) -> ReportPaths:
    """Render ``RUN/report/`` (HTML, tables, JSON, Markdown, figures) from a fitted run."""
    from .reports import render_report

    return render_report(run_dir, command=command)


def run(
    source: str,
    out: str | os.PathLike,
    *,
    data: DataConfig | None = None,
    selection: Selection | None = None,
    schedule: str | None = None,
    config: SweepConfig | None = None,
    fit: FitConfig | None = None,
    processes: int = 1,
    shard: tuple[int, int] | str | None = None,
    prune_cache: bool = False,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> RunResult:
    """Sweep, fit and report in one call (the arguments of ``sweep``; ``fit`` the fit's
    settings); returns what each stage produced. The report is written also when some fit was
    skipped for lack of points.

    The eight checkpoints of a tiny LM, probed on two windows without the attribution:

    >>> import tempfile
    >>> from peakprobe.config import AttributionConfig
    >>> from peakprobe.toy.tiny_lm import TinyLMConfig, train_tiny_lm
    >>> folder = train_tiny_lm(tempfile.mkdtemp(), TinyLMConfig.quick(), progress=False)
    >>> result = run(str(folder), Path(folder) / "run", data=DataConfig(n_windows=2, window=32),
    ...              config=SweepConfig(attribution=AttributionConfig(enabled=False)),
    ...              fit=FitConfig(t_min_step=1, n_boot=100), progress=False)
    >>> len(result.sweep.done), len(result.sweep.failed)
    (8, 0)
    >>> result.fits.verdict["loss"]["verdict"] in ("consistent", "inconsistent", "inconclusive")
    True
    >>> result.report.html.name
    'report.html'
    """
    from .fits import fit_run

    outcome = sweep(source, out, data=data, selection=selection, schedule=schedule, config=config,
                    processes=processes, shard=shard, prune_cache=prune_cache, force=force,
                    progress=progress, command=command)
    fits = fit_run(out, fit or FitConfig(), progress=progress)
    return RunResult(Path(out), outcome, fits, report(out, command=command))

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
    return RunResult(run_dir, monitor.outcome(), fits, report(run_dir, command=command))


def planted(out: str | os.PathLike, task: str, *, quick: bool = False, seed: int = 0,
            steps: int | None = None, progress: bool = True, command: str | None = None) -> RunResult:
    """Train (or reuse) a planted-bottleneck run (``peakprobe.toy.planted``), then sweep, fit and
    report it: ``OUT/checkpoints/``, ``OUT/eval.jsonl``, ``OUT/run/``."""
    from .toy import planted_trained
    from .toy.planted import PlantedConfig, train_planted, write_eval_jsonl

    out = Path(out)
    cfg = PlantedConfig.quick(task) if quick else PlantedConfig.for_task(task)
    model = replace(cfg.model, seed=seed, **({"steps": steps} if steps is not None else {}))
    cfg = replace(cfg, model=model)
    checkpoints = train_planted(out / "checkpoints", cfg, progress=progress)
    trained = task in planted_trained.TRAINED_TASKS  # gains on every window, as the oracle's loss
    n_windows = 16 if quick or trained else 64
    path = write_eval_jsonl(out / "eval.jsonl", cfg, n_seqs=n_windows)
    # the trained controls' one head is attention (all heads): its gain is searched once
    sweep = SweepConfig(batch_size=16, attribution=AttributionConfig(windows=n_windows, heads="off")
                        if trained else AttributionConfig())
    result = run(str(checkpoints), out / "run", data=DataConfig(data=str(path), n_windows=n_windows,
                                                                window=cfg.seq_len),
                 config=sweep, force=False, progress=progress, command=command)
    if trained:
        planted_trained.write_oracle(out, cfg, result.run_dir)
    return result


def toy_peaked(out: str | os.PathLike, *, optimizer: str = "both", steps: int | None = None,
               seed: int = 0, progress: bool = True) -> ToyResult:
    """The peaked-softmax teacher-student toy: train, fit, plot into ``out``."""
    from .toy import peaked_softmax

    doc = peaked_softmax.reproduce_peaked(Path(out), optimizer=optimizer, steps=steps, seed=seed,
                                    progress=progress)
    return ToyResult(Path(out), doc, peaked_softmax.format_peaked(doc))


def toy_linear(out: str | os.PathLike, *, quick: bool = False, seed: int = 0,
               laws: tuple[str, ...] | None = None, progress: bool = True) -> ToyResult:
    """The solvable linear self-attention toy: its scaling laws (``laws``, default all) simulated
    and against the model's reduced dynamics, into ``out``."""
    from .toy import linear_attention

    doc = linear_attention.reproduce_linear(Path(out), quick=quick, seed=seed, progress=progress, laws=laws)
    return ToyResult(Path(out), doc, linear_attention.format_linear(doc))


# -- compare and fit_curve: families of runs, external loss curves -------------------------------
def _fit_external(path, fit: FitConfig, curve: CurveConfig, *, model=None, n_params=None) -> CurveResult:
    from .checkpoints_index import read_schedule_file
    from .fits.curve import DEFAULT_T_MIN_STEP, fit_curve_models
    from .fits.curve_io import read_curve

    data = read_curve(path, metric=curve.metric, task=curve.task, model=model,
                      allow_metric=curve.allow_metric)
    schedule = None if curve.schedule is None else read_schedule_file(curve.schedule)
    start = DEFAULT_T_MIN_STEP if fit.t_min_step is None else fit.t_min_step
    return fit_curve_models(data, family=curve.family, schedule=schedule, n_params=n_params,
                            t_min_step=start, t_max_step=fit.t_max_step, band=fit.band,
                            n_boot=fit.n_boot, seed=fit.seed, scan=curve.scan)


def fit_curve(path: str | os.PathLike, *, out: str | os.PathLike | None = None, model: str | None = None,
              n_params: float | None = None, fit: FitConfig | None = None,
              curve: CurveConfig | None = None, command: str | None = None) -> FitCurveResult:
    r"""The loss-law fit, 1/3 verdict and window scan of an external curve, and its report.

    ``path``: a CSV / JSON / JSONL table or a folder of lm-eval result JSONs; ``fit``: the window
    (``t_min_step`` default 512), band and bootstrap; ``curve``: how to read it. ``out``
    (default ``<stem>-curve``) receives the comparison report of every model in the file plus
    ``fits.csv``.

    A loss curve L = 2 + 3 t^(-1/3) over 40 steps, fitted with the default window from step 512:

    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> steps = [round(10 ** (2 + 3 * i / 39)) for i in range(40)]
    >>> rows = [f"{s},{2 + 3 * s ** (-1 / 3):.6f}" for s in steps]
    >>> _ = (folder / "curve.csv").write_text("step,loss\n" + "\n".join(rows) + "\n")
    >>> res = fit_curve(folder / "curve.csv", out=folder / "report", model="toy",
    ...                 n_params=1e6, curve=CurveConfig(scan=False))
    >>> [(f.model, round(f.fit.alpha, 3)) for f in res.result.fits]
    [('toy', 0.333)]
    >>> res.table["model"].tolist(), res.report.html.name
    (['toy'], 'compare.html')
    """
    from .fits.curve import fits_table
    from .reports.compare import compare_report, members_from_curves
    from .results import write_bytes

    result = _fit_external(path, fit or FitConfig(), curve or CurveConfig(), model=model, n_params=n_params)
    out = Path(out) if out is not None else Path(f"{Path(path).stem}-curve")
    table = fits_table(result)
    paths = compare_report(members_from_curves(result), out, band=result.band, command=command,
                           failed=result.failed, title=f"peakprobe fit-curve: {Path(path).name}")
    write_bytes(out / "fits.csv", table.to_csv(index=False, lineterminator="\n").encode())
    return FitCurveResult(result, table, paths)


def compare(sources, out: str | os.PathLike, *, fit: FitConfig | None = None,
            curve: CurveConfig | None = None, command: str | None = None) -> ComparePaths:
    """One comparison report over ``sources``: fitted run directories (with manifest.json) and
    external curve files or lm-eval folders (fitted here; every model of a file is a member)."""
    from .reports.compare import compare_report, member_from_run, members_from_curves
    from .results import MANIFEST

    fit, curve = fit or FitConfig(), curve or CurveConfig()
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    members, failed = [], {}
    for src in sources:
        src = Path(src)
        if (src / MANIFEST).exists():
            members.append(member_from_run(src, band=fit.band, n_boot=fit.n_boot, seed=fit.seed,
                                           scan=curve.scan))
        else:
            res = _fit_external(src, fit, curve)
            members += members_from_curves(res)
            failed.update(res.failed)
    return compare_report(members, out, band=fit.band, command=command, failed=failed)
