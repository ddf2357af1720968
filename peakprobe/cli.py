"""The ``peakprobe`` command line: index, probe, sweep, fit, report, run, demo, toy.

Exit codes: 0 success; 1 the work ran but failed (e.g. some checkpoints could not be probed,
recorded in failures.jsonl); 2 bad input (unknown family, missing folder, bad option, empty
data, too few checkpoints to fit), reported as one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path

EXAMPLES = {
    "index": "peakprobe index pythia-160m --select 16\n  peakprobe index ./my-run/",
    "probe": "peakprobe probe ./my-run/step1000 --text eval.txt",
    "sweep": "peakprobe sweep pythia-70m --out runs/p70m --data eval.jsonl --tokenizer ./pythia-tok\n"
    "  peakprobe sweep ./my-run --out runs/mine --data embedded --processes 2\n"
    "  peakprobe sweep pythia-160m --out runs/p160m --data eval.txt --shard $SLURM_ARRAY_TASK_ID/8\n"
    "  accelerate launch -m peakprobe sweep ./my-run --out runs/mine",
    "fit": "peakprobe fit runs/mine --t-min 100",
    "report": "peakprobe report runs/mine",
    "run": "peakprobe run ./my-run --out runs/mine --data eval.txt",
    "demo": "peakprobe demo --out peakprobe-demo",
    "toy": "peakprobe toy peaked --out toy-peaked\n  peakprobe toy linear --out toy-linear --quick\n"
    "  peakprobe toy planted --task attention --out planted-attention",
}


def _parser_with_examples(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name, help=help_text, description=help_text,
        epilog="example:\n  " + EXAMPLES[name], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # -q / -v work before or after the subcommand.
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.replace(" ", "").split(",") if s]


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi)


def _add_selection(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint selection")
    g.add_argument("--select", type=int, metavar="N", help="pick N checkpoints (first and last included)")
    g.add_argument("--spacing", choices=["log", "linear"], default="log", help="spacing of --select (default log)")
    g.add_argument("--steps", type=_steps, help="explicit steps, comma-separated")
    g.add_argument("--step-range", type=_range, metavar="A:B", help="only steps in [A, B]")
    g.add_argument("--revisions", type=lambda s: s.split(","), help="explicit revisions, comma-separated")
    g.add_argument("--schedule", metavar="FILE",
                   help="learning-rate schedule giving tau: JSON, CSV (step, lr; W&B export) or trainer_state.json")


def _api_default(name: str):
    """A keyword default of ``api.sweep`` (data options): the one source, read, not repeated."""
    import inspect

    from . import api

    return inspect.signature(api.sweep).parameters[name].default


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    from .config import (
        BACKENDS,
        HEAD_GAIN_MODES,
        STATS_DTYPES,
        WEIGHT_DTYPES,
        ProbeConfig,
        SweepConfig,
    )
    from .config import default as d
    from .vocab import HEAD_GAIN_FLOOR

    _add_selection(p)
    g = p.add_argument_group("evaluation data")
    g.add_argument("--data", default=_api_default("data"),
                   help="'embedded', a .txt/.jsonl file, or hf:NAME[:CONFIG]:SPLIT (default %(default)s)")
    g.add_argument("--text-field", default=_api_default("text_field"),
                   help="JSONL / dataset text field (default %(default)s)")
    g.add_argument("--n-windows", type=int, default=_api_default("n_windows"),
                   help="evaluation windows (default %(default)s)")
    g.add_argument("--window", type=int, default=_api_default("window"),
                   help="tokens per window (default 1024, clamped to the model's maximum positions)")
    g.add_argument("--layout", choices=["document", "packed"], default=_api_default("layout"),
                   help="one document per window, right-padded (default, as the 1/3 papers), or "
                   "documents packed into full windows")
    g.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's own)")
    m = p.add_argument_group("loading and probing")
    m.add_argument("--batch-size", type=int, default=d(SweepConfig, "batch_size"),
                   help="windows per forward pass (default %(default)s)")
    m.add_argument("--dtype", default=d(SweepConfig, "dtype"),
                   help=f"weights dtype: auto, {', '.join(WEIGHT_DTYPES)} (default %(default)s)")
    m.add_argument("--device", default=d(SweepConfig, "device"), help="auto, cpu, cuda, cuda:1 ...")
    m.add_argument("--device-map", help="'auto' to spread a large checkpoint over devices")
    m.add_argument("--allow-pickle", action="store_true", help="accept pickle (.bin) weights")
    m.add_argument("--trust-remote-code", action="store_true")
    m.add_argument("--chunk", type=int, default=d(ProbeConfig, "chunk"),
                   help="query rows per logits block (default: 32 on CPU, the fastest there; "
                   "on a GPU sized to a block of 2^25 logits)")
    m.add_argument("--stats-dtype", choices=STATS_DTYPES, default=d(ProbeConfig, "dtype"))
    m.add_argument("--no-sensitivity", action="store_true",
                   help="skip the attribution (d loss / d log beta, curvature, optimal-temperature gain "
                   "per site); same as --attribution-windows 0")
    m.add_argument("--attribution-windows", type=int, default=d(ProbeConfig, "attribution_windows"),
                   metavar="N",
                   help="run the attribution on the first N evaluation windows (default %(default)s; 0 = off)")
    m.add_argument("--head-gains", choices=HEAD_GAIN_MODES, default=d(ProbeConfig, "attribution_heads"),
                   help="single heads' gains: screen (default: one loss evaluation a head, and a "
                   f"search to 2%% where the gain may reach half of {HEAD_GAIN_FLOOR:g} of the loss), "
                   "search (every head, to xtol), estimate (the local quadratic estimate alone), "
                   "off (sensitivity only)")
    m.add_argument("--backend", choices=BACKENDS, default=d(ProbeConfig, "backend"),
                   help="statistics path: auto (default: torch; the Triton kernel covers only the "
                   "base metrics, so it adds to the torch path's time), torch, compile "
                   "(torch.compile fuses each block's passes: faster on long sweeps, one-off "
                   "compile of minutes on CPU, needs a C++ compiler), triton")
    m.add_argument("--fused-attention", action="store_true",
                   help="compute attention outputs from the probe's own scores (QK^T once; outputs "
                   "within rounding of eager, not bit-identical; off by default)")
    m.add_argument("--no-prefetch", action="store_true", help="do not load the next checkpoint ahead")
    p.add_argument("--processes", type=int, default=1, help="split checkpoints over N local processes")
    p.add_argument("--shard", metavar="K/N",
                   help="probe only checkpoints K, K+N, ... (job arrays: one K per job, same --out)")
    p.add_argument("--prune-cache", action="store_true",
                   help="delete each hub revision this sweep downloaded from the HF cache once its results are written")
    p.add_argument("--force", action="store_true", help="discard an existing run in --out and start over")


def _band(text: str) -> tuple[float, float]:
    """--band LO,HI: the equivalence band around 1/3 of the three-way verdicts."""
    from .fits.third import check_band

    try:
        return check_band(tuple(float(v) for v in text.split(",")))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. --band 0.25,0.42)") from None


def _add_fit_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fitting")
    g.add_argument("--time-axis", choices=["auto", "tau", "step"],
                   help="tau when every checkpoint has one (default auto), or step")
    g.add_argument("--t-min", type=float, help="window start in time-axis units (default: the "
                   "family's start step, e.g. 512 for Pythia, else past warmup)")
    g.add_argument("--t-max", type=float, help="window end in time-axis units (default: last checkpoint)")
    g.add_argument("--t-min-step", type=int, help="window start as a step")
    g.add_argument("--t-max-step", type=int, help="window end as a step")
    g.add_argument("--band", type=_band, default=None, metavar="LO,HI",
                   help="equivalence band around 1/3 for the verdicts (default 0.25,0.42)")
    g.add_argument("--n-boot", type=int, help="bootstrap resamples (default: fit_run's, 1000)")
    g.add_argument("--seed", type=int, help="bootstrap seed (default: fit_run's, 0)")


# -- compare and fit-curve: families of runs, external loss curves ------------------------------
EXAMPLES["compare"] = ("peakprobe compare runs/p70m runs/p160m runs/p410m --out cmp\n"
                       "  peakprobe compare evals.csv --out cmp --family pythia-160m")
EXAMPLES["fit-curve"] = ("peakprobe fit-curve tests/data/pythia_lambada.csv --out lambada\n"
                         "  peakprobe fit-curve lm-eval-out/ --task lambada_openai --family pythia-160m")


def _compare_band(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(",")
    try:
        return float(lo), float(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (e.g. 0.25,0.42), got {text!r}") from None


def _add_curve_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("external curves (CSV / JSON / JSONL / lm-eval folders)")
    g.add_argument("--metric", help="metric column or lm-eval metric (default: the one loss or perplexity)")
    g.add_argument("--task", help="lm-eval task (default: the one task with a perplexity)")
    g.add_argument("--allow-metric", action="store_true",
                   help="fit a metric that is not a loss or perplexity as given (e.g. 1 - acc)")
    g.add_argument("--family", help="Pythia size for tau and parameters, e.g. pythia-160m "
                   "(default: from each model's name)")
    g.add_argument("--schedule", help="schedule.json giving the learning-rate schedule (tau)")
    g.add_argument("--t-min-step", type=float, default=512, help="first step of the fit window (default 512)")
    g.add_argument("--t-max-step", type=float, help="last step of the fit window (default: the last)")
    g = p.add_argument_group("fitting")
    g.add_argument("--band", type=_compare_band, default=None, metavar="LO,HI",
                   help="equivalence band around 1/3 (default 0.25,0.42)")
    g.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-scan", action="store_true", help="skip the window scan")


def _add_compare_commands(sub) -> None:
    p = _parser_with_examples(sub, "compare", "one HTML report over several fitted runs or curves")
    p.add_argument("sources", nargs="+", metavar="RUN",
                   help="fitted run directories, or curve files / lm-eval folders")
    p.add_argument("--out", required=True, help="output folder")
    _add_curve_options(p)
    p = _parser_with_examples(sub, "fit-curve", "loss-law fit, 1/3 verdict and report of an external curve")
    p.add_argument("file", help="CSV, JSON or JSONL table, or a folder of lm-eval result JSONs")
    p.add_argument("--out", help="report folder (default: <file stem>-curve)")
    p.add_argument("--model", help="model name for a single-model file")
    p.add_argument("--n-params", type=float, help="parameter count (default: Pythia's table, if known)")
    _add_curve_options(p)


def _curve_kwargs(args) -> dict:
    from .vocab import BAND

    return dict(metric=args.metric, task=args.task, allow_metric=args.allow_metric,
                family=args.family, schedule=args.schedule, t_min_step=args.t_min_step,
                t_max_step=args.t_max_step, band=args.band or BAND, n_boot=args.n_boot,
                seed=args.seed, scan=not args.no_scan)


def _dispatch_compare(args, command: str) -> int | None:
    from . import api

    if args.command == "compare":
        kw = _curve_kwargs(args)
        band, n_boot, seed, scan = (kw.pop(k) for k in ("band", "n_boot", "seed", "scan"))
        paths = api.compare(args.sources, args.out, band=band, n_boot=n_boot, seed=seed,
                            scan=scan, command=command, curve_kwargs=kw)
        _say(args, f"compare report: {paths.html}")
        return 0
    if args.command == "fit-curve":
        from .fits.curve import format_curve_result

        res = api.fit_curve(args.file, out=args.out, model=args.model, n_params=args.n_params,
                            command=command, **_curve_kwargs(args))
        _say(args, format_curve_result(res.result))
        _say(args, f"report: {res.report.html}")
        return 0
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peakprobe",
        description="Find the softmax that bottlenecks training: per-head peakedness and logit "
        "growth across checkpoints, t^(1/3) fits, and a per-head report.",
        epilog="exit codes: 0 ok, 1 failure, 2 bad input\nstart with: peakprobe demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true",
                           help="no progress bars or summaries (warnings and errors still show)")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="show warnings and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _parser_with_examples(sub, "index", "list a family's or folder's checkpoints (step, tokens, tau)")
    p.add_argument("source", help="pythia-70m, EleutherAI/pythia-410m-deduped, OLMo/Amber hub id, or a run folder")
    _add_selection(p)

    p = _parser_with_examples(sub, "probe", "per-head table for one checkpoint folder")
    p.add_argument("model_dir")
    p.add_argument("--text", default="embedded", help="text file, JSONL, or 'embedded'")
    p.add_argument("--n-windows", type=int, default=8)
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default 1024, clamped to the model's maximum positions)")
    p.add_argument("--layout", choices=["document", "packed"], default="document")
    p.add_argument("--metric", default="logit_std", help="metric to sort heads by (default logit_std)")
    p.add_argument("--allow-pickle", action="store_true")

    p = _parser_with_examples(sub, "sweep", "probe every selected checkpoint; write RUN/checkpoints/*.parquet")
    p.add_argument("source")
    p.add_argument("--out", required=True, help="run directory")
    _add_sweep_options(p)

    p = _parser_with_examples(sub, "fit", "fit growth and loss laws; write RUN/fits.parquet and fits.json")
    p.add_argument("run_dir")
    _add_fit_options(p)

    p = _parser_with_examples(sub, "report", "render RUN/report/ (HTML, CSV, JSON, Markdown, figures)")
    p.add_argument("run_dir")

    p = _parser_with_examples(sub, "run", "sweep + fit + report in one go")
    p.add_argument("source")
    p.add_argument("--out", required=True, help="run directory")
    _add_sweep_options(p)
    _add_fit_options(p)

    p = _parser_with_examples(sub, "demo", "train the embedded tiny LM, then sweep, fit and report it")
    p.add_argument("--out", default="peakprobe-demo", help="output folder (default peakprobe-demo)")
    p.add_argument("--quick", action="store_true", help="a shorter training run (for tests)")

    p = _parser_with_examples(sub, "toy", "the source papers' toy models")
    p.add_argument("which", choices=["peaked", "linear", "planted"])
    p.add_argument("--out", required=True)
    p.add_argument("--optimizer", choices=["sgd", "adam", "both"], default="both", help="peaked toy only")
    p.add_argument("--steps", type=int, help="peaked / planted toy: training steps")
    p.add_argument("--quick", action="store_true", help="linear / planted toy: a smaller run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=["lm_head", "attention", "lag_copy", "teacher_attention"], default="lm_head",
                   help="planted toy: which softmax is the bottleneck by construction (default lm_head)")
    _add_compare_commands(sub)
    return parser


def _sweep_kwargs(args, command: str) -> dict:
    from .config import ProbeConfig, SweepConfig

    probe = ProbeConfig(chunk=args.chunk, dtype=args.stats_dtype,
                        sensitivity=not args.no_sensitivity, backend=args.backend,
                        attribution_windows=args.attribution_windows,
                        attribution_heads=args.head_gains, fused=args.fused_attention)
    config = SweepConfig(
        batch_size=args.batch_size, dtype=args.dtype, device=args.device, device_map=args.device_map,
        allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code,
        prefetch=not args.no_prefetch, probe=probe,
    )
    return dict(
        data=args.data, n_windows=args.n_windows, window=args.window, text_field=args.text_field,
        layout=args.layout,
        tokenizer=args.tokenizer, n=args.select, spacing=args.spacing, steps=args.steps,
        step_range=args.step_range, revisions=args.revisions, config=config,
        processes=args.processes, force=args.force, progress=not args.quiet, command=command,
        schedule=args.schedule, shard=args.shard, prune_cache=args.prune_cache,
    )


def _fit_kwargs(args) -> dict:
    """What the user set; everything else takes ``fit_run``'s own defaults (one source)."""
    given = dict(time_axis=args.time_axis, t_min=args.t_min, t_max=args.t_max,
                 t_min_step=args.t_min_step, t_max_step=args.t_max_step, band=args.band,
                 n_boot=args.n_boot, seed=args.seed)
    return {**{k: v for k, v in given.items() if v is not None}, "progress": not args.quiet}


def _say(args, text: str) -> None:
    if not args.quiet:
        print(text)


def _sweep_status(args, summary) -> int:
    busy = f", {len(summary.busy)} held by another process" if summary.busy else ""
    _say(args, f"{len(summary.done)} checkpoints probed, {len(summary.skipped)} already done, "
               f"{len(summary.failed)} failed{busy} -> {summary.run_dir}")
    if summary.failed:
        print(f"peakprobe: {len(summary.failed)} checkpoints failed ({', '.join(summary.failed[:5])}); "
              f"see {summary.run_dir / 'failures.jsonl'}", file=sys.stderr)
        return 1
    return 0


def _dispatch(args, command: str) -> int:
    from . import api

    if args.command == "index":
        from .checkpoints_index import format_index

        seq = api.index(args.source, n=args.select, spacing=args.spacing, steps=args.steps,
                        step_range=args.step_range, revisions=args.revisions, schedule=args.schedule)
        print(format_index(seq))
        return 0
    if args.command == "probe":
        from .probe_one import format_probe_table, probe_folder

        frame = probe_folder(args.model_dir, text=args.text, n_windows=args.n_windows,
                             window=args.window, layout=args.layout, allow_pickle=args.allow_pickle)
        print(format_probe_table(frame, sort_by=args.metric))
        return 0
    if args.command == "sweep":
        return _sweep_status(args, api.sweep(args.source, args.out, **_sweep_kwargs(args, command)))
    if args.command == "fit":
        from .fits import format_summary

        fits = api.fit(args.run_dir, **_fit_kwargs(args))
        _say(args, format_summary(fits))
        return 0
    if args.command == "report":
        paths = api.report(args.run_dir, command=command)
        _say(args, f"report: {paths.html}")
        return 0
    if args.command == "run":
        from .fits import format_summary

        result = api.run(args.source, args.out, fit_kwargs=_fit_kwargs(args),
                         **_sweep_kwargs(args, command))
        status = _sweep_status(args, result.sweep)
        _say(args, format_summary(result.fits))
        _say(args, f"report: {result.report.html}")
        return status
    if args.command == "demo":
        from .fits import format_summary

        result = api.demo(args.out, quick=args.quick, progress=not args.quiet, command=command)
        _say(args, format_summary(result.fits))
        _say(args, f"report: {result.report.html}")
        return _sweep_status(args, result.sweep) if result.sweep.failed else 0
    if args.command == "toy":
        from .toy import linear_attention, peaked_softmax

        out = Path(args.out)
        if args.which == "planted":  # train, then sweep + fit + report; the verdict names a softmax
            from .fits import format_summary

            result = api.planted(out, args.task, quick=args.quick, seed=args.seed, steps=args.steps,
                                 progress=not args.quiet, command=command)
            _say(args, f"planted {args.task}: checkpoints in {out / 'checkpoints'}, "
                       f"eval data {out / 'eval.jsonl'}, run in {result.run_dir}")
            _say(args, format_summary(result.fits))
            _say(args, f"report: {result.report.html}")
            return _sweep_status(args, result.sweep) if result.sweep.failed else 0
        if args.which == "peaked":
            summary = peaked_softmax.cli_peaked(out, optimizer=args.optimizer, steps=args.steps,
                                                seed=args.seed, progress=not args.quiet)
            _say(args, peaked_softmax.format_peaked(summary))
        else:
            summary = linear_attention.cli_linear(out, quick=args.quick, seed=args.seed,
                                                  progress=not args.quiet)
            _say(args, linear_attention.format_linear(summary))
        _say(args, f"plots and summary.json: {out}")
        return 0
    if (status := _dispatch_compare(args, command)) is not None:
        return status
    raise AssertionError(args.command)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message).strip().splitlines()
    print(f"peakprobe: warning: {text[0] if text else category.__name__}", file=sys.stderr)


def _route_warnings(args) -> None:
    """peakprobe's own warnings once each, as one line, also under -q (which silences progress
    and summaries, not what a user must know); other libraries' warnings hidden unless -v,
    which shows every warning with its origin."""
    if args.verbose:
        warnings.simplefilter("default")
        return
    from .vocab import PeakprobeWarning

    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=PeakprobeWarning)
    warnings.showwarning = _one_line_warning  # restored by catch_warnings in main
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    command = "peakprobe " + shlex.join(argv)
    try:
        with warnings.catch_warnings():
            _route_warnings(args)
            return _dispatch(args, command)
    except KeyboardInterrupt:
        print("peakprobe: interrupted; finished checkpoints are kept, re-run to resume", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        if args.verbose:
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"peakprobe: error: {message}", file=sys.stderr)
        return 2
