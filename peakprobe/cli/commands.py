"""The subcommands of ``peakprobe``: one ``Command`` each (its help, example, options and what it
runs), gathered in ``COMMANDS``. Options come from the configuration records (``options``); the
work is ``peakprobe.api``'s. Each ``run`` returns the exit code: 0 ok, 1 the work ran but part of
it failed (checkpoints in failures.jsonl, a fit skipped for lack of points).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import results, vocab
from ..checkpoints_index.selection import Selection
from ..config import (
    AttributionConfig,
    CurveConfig,
    DataConfig,
    FitConfig,
    ProbeConfig,
    SweepConfig,
)
from ..formatting import short_list
from ..vocab import BETA_EFF
from .options import DeprecatedSwitch, add_record, add_verbosity, record_from


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add`` adds its arguments, ``run(args, command_line)`` does the work."""

    name: str
    help: str
    example: str
    add: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, str], int]


def say(args: argparse.Namespace, text: str) -> None:
    """Print ``text`` unless ``-q``."""
    if not args.quiet:
        print(text)


# -- option groups ------------------------------------------------------------------------------
def _add_selection(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint selection")
    add_record(g, Selection, "sel")
    g.add_argument("--schedule", metavar="FILE",
                   help="learning-rate schedule giving tau: JSON, CSV (step, lr; W&B export) or trainer_state.json")


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    _add_selection(p)
    add_record(p.add_argument_group("evaluation data"), DataConfig, "data")
    g = p.add_argument_group("loading and probing")
    add_record(g, SweepConfig, "load")
    add_record(g, ProbeConfig, "probe")
    g = p.add_argument_group("attribution")
    add_record(g, AttributionConfig, "attr")
    g.add_argument("--no-sensitivity", action=DeprecatedSwitch, dest="attr__enabled", const=False,
                   instead="--no-attribution")
    g = p.add_argument_group("scale-out and resumption")
    g.add_argument("--processes", type=int, default=1, help="split checkpoints over N local processes")
    g.add_argument("--shard", metavar="K/N",
                   help="probe only checkpoints K, K+N, ... (job arrays: one K per job, same --out)")
    g.add_argument("--prune-cache", action="store_true",
                   help="delete each hub revision this sweep downloaded from the HF cache once its results are written")
    g.add_argument("--force", action="store_true", help="discard an existing run in --out and start over")


def _add_fit_options(p: argparse.ArgumentParser) -> None:
    add_record(p.add_argument_group("fitting"), FitConfig, "fit")


def _add_curve_options(p: argparse.ArgumentParser) -> None:
    add_record(p.add_argument_group("external curves (CSV / JSON / JSONL / lm-eval folders)"),
               CurveConfig, "curve")
    add_record(p.add_argument_group("fitting"), FitConfig, "fit",
               only=("t_min_step", "t_max_step", "band", "n_boot", "seed"))


def _selection(args) -> Selection:
    return record_from(args, Selection, "sel")


def _sweep_kwargs(args, command: str) -> dict:
    config = record_from(args, SweepConfig, "load", probe=record_from(args, ProbeConfig, "probe"),
                         attribution=record_from(args, AttributionConfig, "attr"))
    return dict(data=record_from(args, DataConfig, "data"), selection=_selection(args),
                schedule=args.schedule, config=config, processes=args.processes,
                shard=args.shard, prune_cache=args.prune_cache, force=args.force,
                progress=not args.quiet, command=command)


def _fit_config(args) -> FitConfig:
    return record_from(args, FitConfig, "fit")


def _curve_config(args) -> FitConfig:
    return record_from(args, FitConfig, "fit", only=("t_min_step", "t_max_step", "band", "n_boot", "seed"))


# -- reporting what was done ------------------------------------------------------------------------
def sweep_status(args, outcome) -> int:
    """One line on what a sweep did; 1 when checkpoints failed."""
    busy = f", {len(outcome.busy)} held by another process" if outcome.busy else ""
    say(args, f"{len(outcome.done)} checkpoints probed, {len(outcome.skipped)} already done, "
              f"{len(outcome.failed)} failed{busy} -> {outcome.run_dir}")
    if outcome.failed:
        errors = {r.get("revision"): r.get("error") for r in results.read_failures(outcome.run_dir)}
        first = outcome.failed[0]
        why = f" {first}: {errors[first]}" if errors.get(first) else ""
        print(f"peakprobe: {len(outcome.failed)} checkpoints failed ({short_list(outcome.failed)};{why}); "
              f"the others are kept: re-run to retry, see {outcome.run_dir / 'failures.jsonl'}",
              file=sys.stderr)
        return 1
    return 0


def fit_status(fits) -> int:
    """1 when a fit was skipped for lack of points (said on stderr, with the option that widens
    the window); 0 otherwise."""
    for s in fits.skipped:
        print(f"peakprobe: {s['fit']} fit skipped: {s['reason']}", file=sys.stderr)
    return 1 if fits.skipped else 0


# -- the commands -------------------------------------------------------------------------------
def _index_add(p):
    p.add_argument("source", help="pythia-70m, EleutherAI/pythia-410m-deduped, OLMo/Amber hub id, or a run folder")
    _add_selection(p)


def _index_run(args, command):
    from .. import api
    from ..checkpoints_index import format_index

    print(format_index(api.index(args.source, selection=_selection(args), schedule=args.schedule)))
    return 0


def _probe_add(p):
    from ..probe_one import PROBE_WINDOWS

    p.add_argument("model_dir", help="a save_pretrained folder (config.json, weights, tokenizer)")
    add_record(p.add_argument_group("evaluation data"), DataConfig, "data")
    p.set_defaults(data__n_windows=PROBE_WINDOWS)  # one checkpoint: fewer windows than a sweep
    p.add_argument("--metric", default=BETA_EFF,
                   help="metric to sort heads by (default %(default)s)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept pickle (.bin) weights: they can run code when loaded")


def _probe_run(args, command):
    from .. import api
    from ..probe_one import format_probe_table

    frame = api.probe(args.model_dir, record_from(args, DataConfig, "data"),
                      allow_pickle=args.allow_pickle)
    print(format_probe_table(frame, sort_by=args.metric))
    return 0


def _sweep_add(p):
    p.add_argument("source")
    p.add_argument("--out", required=True, help="run directory")
    _add_sweep_options(p)


def _sweep_run(args, command):
    from .. import api

    return sweep_status(args, api.sweep(args.source, args.out, **_sweep_kwargs(args, command)))


def _fit_add(p):
    p.add_argument("run_dir")
    _add_fit_options(p)


def _fit_run(args, command):
    from .. import api
    from ..fits import format_fits

    fits = api.fit(args.run_dir, _fit_config(args), progress=not args.quiet)
    say(args, format_fits(fits))
    return fit_status(fits)


def _report_add(p):
    p.add_argument("run_dir")


def _report_run(args, command):
    from .. import api

    say(args, f"report: {api.report(args.run_dir, command=command).html}")
    return 0


def _run_add(p):
    _sweep_add(p)
    _add_fit_options(p)


def _finish(args, result, *, sweep_line: bool = False, roles_line: bool = False) -> int:
    """Print a fitted run's verdicts and report (and the sweep's line when asked for or when
    checkpoints failed; its head roles' line when asked for); the worst of the sweep's and the
    fits' exit codes."""
    from ..fits import format_fits
    from ..reports.markdown import roles_text

    status = sweep_status(args, result.sweep) if (sweep_line or result.sweep.failed) else 0
    say(args, format_fits(result.fits))
    if roles_line and (roles := roles_text(results.read_json(result.report.summary_json).get("roles", {}))):
        say(args, roles)
    say(args, f"report: {result.report.html}")
    return max(status, fit_status(result.fits))


def _run_run(args, command):
    from .. import api

    result = api.run(args.source, args.out, fit=_fit_config(args), **_sweep_kwargs(args, command))
    return _finish(args, result, sweep_line=True)


def _demo_add(p):
    p.add_argument("--out", default="peakprobe-demo", help="output folder (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a shorter training run (for tests)")


def _demo_run(args, command):
    from .. import api

    # the demo names its head roles too (a run's report lists them in its "Head roles" section)
    return _finish(args, api.demo(args.out, quick=args.quick, progress=not args.quiet, command=command),
                   roles_line=True)


PLANTED_TASKS = ("lm_head", "attention", "lag_copy", "teacher_attention", "trained_qk", "blind_spot",
                 "trained_lm_head")


def _peaked_add(p):
    p.add_argument("--optimizer", choices=["sgd", "adam", "both"], default="both",
                   help="which optimizer's run (default %(default)s)")
    p.add_argument("--steps", type=int, help="training steps (default: the toy's own)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")


def _peaked_run(args, command):
    from .. import api

    toy = api.toy_peaked(args.out, optimizer=args.optimizer, steps=args.steps, seed=args.seed,
                         progress=not args.quiet)
    say(args, toy.text)
    say(args, f"plots and {vocab.TOY_FILE}: {args.out}")
    return 0


def _linear_add(p):
    from ..toy.linear_attention import LAWS

    p.add_argument("--quick", action="store_true", help="a smaller run")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--law", choices=(*LAWS, "all"), default="all",
                   help="which scaling law to reproduce (default: all five)")


def _linear_run(args, command):
    from .. import api

    laws = None if args.law == "all" else (args.law,)
    toy = api.toy_linear(args.out, quick=args.quick, seed=args.seed, laws=laws,
                         progress=not args.quiet)
    say(args, toy.text)
    say(args, f"plots and {vocab.TOY_FILE}: {args.out}")
    return 0


def _planted_add(p):
    p.add_argument("--task", choices=PLANTED_TASKS, default=PLANTED_TASKS[0],
                   help="which softmax is the bottleneck by construction (default %(default)s)")
    p.add_argument("--steps", type=int, help="training steps (default: the task's own)")
    p.add_argument("--quick", action="store_true", help="a smaller run")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")


def _planted_run(args, command):
    """Train, then sweep + fit + report; the verdict names a softmax."""
    from .. import api

    out = Path(args.out)
    result = api.planted(out, args.task, quick=args.quick, seed=args.seed, steps=args.steps,
                         progress=not args.quiet, command=command)
    say(args, f"planted {args.task}: checkpoints in {out / 'checkpoints'}, eval data "
              f"{out / 'eval.jsonl'}, run in {result.run_dir}")
    return _finish(args, result)


#: ``peakprobe toy NAME``: (help, example, add, run) of each toy
TOYS: dict[str, tuple[str, str, Callable, Callable]] = {
    "peaked": ("the peaked-softmax teacher-student toy: logit growth under SGD and Adam",
               "peakprobe toy peaked --out toy-peaked", _peaked_add, _peaked_run),
    "linear": ("the solvable linear self-attention toy: its scaling laws, simulated and in theory",
               "peakprobe toy linear --out toy-linear --quick\n  peakprobe toy linear --out "
               "toy-linear --law model", _linear_add, _linear_run),
    "planted": ("a planted-bottleneck run: trained, swept, fitted and reported",
                "peakprobe toy planted --task attention --out planted-attention",
                _planted_add, _planted_run),
}


def _toy_add(p):
    sub = p.add_subparsers(dest="toy", required=True, metavar="TOY")
    for name, (text, example, add, run) in TOYS.items():
        q = sub.add_parser(name, help=text, description=text, epilog="example:\n  " + example,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_verbosity(q)
        q.add_argument("--out", required=True, help="output folder")
        add(q)
        q.set_defaults(toy_run=run)


def _toy_run(args, command):
    return args.toy_run(args, command)


def _compare_add(p):
    p.add_argument("sources", nargs="+", metavar="RUN",
                   help="fitted run directories, or curve files / lm-eval folders")
    p.add_argument("--out", required=True, help="output folder")
    _add_curve_options(p)


def _compare_run(args, command):
    from .. import api

    paths = api.compare(args.sources, args.out, fit=_curve_config(args),
                        curve=record_from(args, CurveConfig, "curve"), command=command)
    say(args, f"compare report: {paths.html}")
    return 0


def _fit_curve_add(p):
    p.add_argument("file", help="CSV, JSON or JSONL table, or a folder of lm-eval result JSONs")
    p.add_argument("--out", help="report folder (default: <file stem>-curve)")
    p.add_argument("--model", help="model name for a single-model file")
    p.add_argument("--n-params", type=float, help="parameter count (default: Pythia's table, if known)")
    _add_curve_options(p)


def _fit_curve_run(args, command):
    from .. import api
    from ..fits.curve import format_curve_result

    res = api.fit_curve(args.file, out=args.out, model=args.model, n_params=args.n_params,
                        fit=_curve_config(args), curve=record_from(args, CurveConfig, "curve"),
                        command=command)
    say(args, format_curve_result(res.result))
    say(args, f"report: {res.report.html}")
    return 0


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("index", "list a family's or folder's checkpoints (step, tokens, tau)",
            "peakprobe index pythia-160m --select 16\n  peakprobe index ./my-run/", _index_add, _index_run),
    Command("probe", "per-head table for one checkpoint folder",
            "peakprobe probe ./my-run/step1000 --data eval.txt", _probe_add, _probe_run),
    Command("sweep", "probe every selected checkpoint; write RUN/checkpoints/*.parquet",
            "peakprobe sweep pythia-70m --out runs/p70m --data eval.jsonl --tokenizer ./pythia-tok\n"
            "  peakprobe sweep ./my-run --out runs/mine --data embedded --processes 2\n"
            "  peakprobe sweep pythia-160m --out runs/p160m --data eval.txt --shard $SLURM_ARRAY_TASK_ID/8\n"
            "  accelerate launch -m peakprobe sweep ./my-run --out runs/mine", _sweep_add, _sweep_run),
    Command("fit", "fit growth and loss laws; write RUN/fits.parquet and fits.json",
            "peakprobe fit runs/mine --t-min 100", _fit_add, _fit_run),
    Command("report", "render RUN/report/ (HTML, CSV, JSON, Markdown, figures)",
            "peakprobe report runs/mine", _report_add, _report_run),
    Command("run", "sweep + fit + report in one go",
            "peakprobe run ./my-run --out runs/mine --data eval.txt", _run_add, _run_run),
    Command("demo", "train the embedded tiny LM while probing it live, then fit and report it",
            "peakprobe demo --out peakprobe-demo", _demo_add, _demo_run),
    Command("toy", "the source papers' toy models: toy peaked, toy linear, toy planted",
            "peakprobe toy peaked --out toy-peaked\n  peakprobe toy linear --out toy-linear --quick\n"
            "  peakprobe toy linear --out toy-linear --law model\n"
            "  peakprobe toy planted --task attention --out planted-attention", _toy_add, _toy_run),
    Command("compare", "one HTML report over several fitted runs or curves",
            "peakprobe compare runs/p70m runs/p160m runs/p410m --out cmp\n"
            "  peakprobe compare evals.csv --out cmp --family pythia-160m", _compare_add, _compare_run),
    Command("fit-curve", "loss-law fit, 1/3 verdict and report of an external curve",
            "peakprobe fit-curve tests/data/pythia_lambada.csv --out lambada\n"
            "  peakprobe fit-curve lm-eval-out/ --task lambada_openai --family pythia-160m",
            _fit_curve_add, _fit_curve_run),
)}
