"""``peakprobe toy linear``: run the laws asked for, write their figures and record, print them.

``reproduce_linear`` runs any subset of ``laws.LAWS`` (the size sweep once for the time, model-size and
compute laws; the data and context experiments on their own) and writes one figure per law,
``linear_attention_table.csv`` (the size sweep) and ``vocab.TOY_FILE``; ``format_linear`` is
the terminal summary. What each law measures: docs/linear_attention.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from peakprobe import vocab
from peakprobe.results import write_json
from peakprobe.toy import ToyConfigError
from peakprobe.toy.linear_attention.config import DEFAULT
from peakprobe.toy.linear_attention.context import context_law
from peakprobe.toy.linear_attention.data import data_law
from peakprobe.toy.linear_attention.laws import (
    EXPONENT_HALF_WIDTH,
    LAWS,
    Exponent,
    LawResult,
    compute_law,
    format_exponent,
    model_law,
    time_law,
)
from peakprobe.toy.linear_attention.plots import (
    plot_compute,
    plot_context,
    plot_data,
    plot_linear_attention,
)
from peakprobe.toy.linear_attention.sweep import FULL, QUICK, compare, simulate_linear_attention

__all__ = ["reproduce_linear", "format_linear"]

TABLE_FILE = "linear_attention_table.csv"


def _normalize_laws(laws: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if laws is None or laws == "all":
        return LAWS
    names = (laws,) if isinstance(laws, str) else tuple(laws)
    if "all" in names:
        return LAWS
    bad = [n for n in names if n not in LAWS]
    if bad or not names:
        raise ToyConfigError(f"unknown law(s) {bad or names}: choose from {', '.join(LAWS)} or all")
    return tuple(n for n in LAWS if n in names)


def _jsonable(obj: object) -> object:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _size_sweep(chosen: tuple[str, ...], settings: dict, seed: int, progress: bool,
                out_dir: Path, record: dict) -> tuple[list[LawResult], object]:
    """The size sweep and the laws read off it (time, model size, compute)."""
    t0 = time.perf_counter()
    sim = simulate_linear_attention(**settings, seed=seed, progress=progress)
    comparison = compare(sim, seed=seed)
    sweep_s = time.perf_counter() - t0
    record.update(config=sim.config, wall_s=sim.wall_s, **comparison.summary)
    record["table"] = comparison.table.to_dict(orient="records")
    record["curves"] = {"t": sim.t, "sim_mean": sim.loss.mean(axis=1),
                        "reduced": comparison.reduced_binned}
    comparison.table.to_csv(out_dir / TABLE_FILE, index=False)
    paths = plot_linear_attention(comparison, out_dir)
    results = [fn(comparison) for law, fn in (("time", time_law), ("model", model_law))
               if law in chosen]
    if "compute" in chosen:
        res, plot_data = compute_law(comparison, seed=seed)
        paths.append(plot_compute(comparison, res, plot_data, out_dir))
        results.append(res)
    for res in results:
        res.wall_s = sweep_s
    record["plots"] += [p.name for p in paths]
    return results, comparison


def reproduce_linear(out_dir: Path, *, quick: bool = False, seed: int = 0, progress: bool = True,
               laws: str | tuple[str, ...] | list[str] | None = None) -> dict:
    """``peakprobe toy linear``: run the requested ``laws`` (None or "all": every one of
    ``LAWS``), write one figure per law, ``linear_attention_table.csv`` (size sweep) and
    ``vocab.TOY_FILE`` into ``out_dir``; return what that file holds."""
    chosen = _normalize_laws(laws)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    settings = {**asdict(DEFAULT), **(QUICK if quick else FULL)}
    record: dict = {"toy": "linear_attention", "quick": bool(quick), "laws": list(chosen),
                    "half_width": EXPONENT_HALF_WIDTH, "config": dict(settings, seed=seed),
                    "results": {}, "plots": []}
    results: list[LawResult] = []
    comparison = None
    if {"time", "model", "compute"} & set(chosen):
        results, comparison = _size_sweep(chosen, settings, seed, progress, out_dir, record)
    if "data" in chosen:
        res, run = data_law(quick=quick, seed=seed, progress=progress, fresh=comparison)
        record["plots"].append(plot_data(run, res, out_dir).name)
        results.append(res)
    if "context" in chosen:
        res, run = context_law(quick=quick, seed=seed, progress=progress)
        record["plots"].append(plot_context(run, res, out_dir).name)
        results.append(res)
    order = {law: i for i, law in enumerate(LAWS)}
    results.sort(key=lambda r: order[r.law])
    record["results"] = {r.law: r.to_dict() for r in results}
    record["total_wall_s"] = time.perf_counter() - start
    record = _jsonable(record)
    write_json(out_dir / vocab.TOY_FILE, record)
    return record


_EXP_KEYS = ("name", "law", "fitted", "lo", "hi", "reduced", "predicted", "half_width")


def _exponent(e: dict) -> str:
    return format_exponent(Exponent(**{k: e[k] for k in _EXP_KEYS}))


def format_linear(record: dict) -> str:
    """What ``peakprobe toy linear`` prints: for the size sweep, whether simulation and reduced
    dynamics agree and the time exponent in detail; then each law that was run, one line per
    law, or a title line and one line per exponent for a law with more than two."""
    lines = []
    if "n_sizes_agree" in record:
        lines.append(f"linear attention (a = {record['config']['zipf_a']:g}): "
                     f"{record['n_sizes_agree']} model sizes agree with the reduced dynamics "
                     f"({record['criteria']}): {'yes' if record['acceptance'] else 'no'}")
        t = record.get("time")
        if t is not None and "time" in record["results"]:
            lines.append(
                f"  time exponent, M = {t['model_size']}: simulation {t['alpha_sim']:.3f} "
                f"[{t['alpha_sim_lo']:.3f}, {t['alpha_sim_hi']:.3f}] (90% CI), reduced ODE "
                f"{t['alpha_reduced']:.3f}, closed form a/(1+a) = {t['alpha_theory']:.3f} "
                "(set by the data spectrum, not by 1/3)")
    for law in LAWS:
        res = record["results"].get(law)
        if res is None:
            continue
        exps = res["exponents"]
        if len(exps) <= 2:
            lines.append(f"{res['title']}: "
                         + "; ".join(f"{e['law']}: {_exponent(e)}" for e in exps))
        else:
            lines.append(f"{res['title']}:")
            lines += [f"  {e['law']}: {_exponent(e)}" for e in exps]
    return "\n".join(lines)
