"""Reading an external loss curve: a CSV, JSON or JSONL table, or a folder of
lm-evaluation-harness result files, into one tidy table ``model, step, value``.

Tables: one row per (model, step) with a ``step`` (or ``revision``: ``step1000``,
``checkpoint-1000``, ``...-step1000``) column, an optional ``model`` column (default: the
file's stem), optional ``tau`` and ``n_params`` (parameter count) columns, and the metric in a column of its own (``loss``,
``perplexity``, ``ppl``, ... or the one named by ``metric``). A long table with ``metric`` and
``value`` columns works too. Lines starting with ``#`` in a CSV are comments.

lm-eval folders: every ``*.json`` below the folder that has a ``"results"`` object (lm-eval
writes ``results_<timestamp>.json``). The model and revision come from
``config.model_args`` (``pretrained=EleutherAI/pythia-160m,revision=step1000``), else the
step from the file name. Metric keys are read both in the current form (``"perplexity,none"``)
and the older one (``"perplexity"``, ``"ppl"``); the part after the comma is lm-eval's filter.

Perplexity-like metrics are turned into a loss by log (flag ``from_perplexity``);
loss-like ones are used as they are; anything else (accuracy, exact match, ...) is refused
unless ``allow_metric`` (flag ``not_a_loss``). Rows without a finite value are dropped (flag
``dropped_rows``), exact duplicate rows are merged (flag ``duplicate_rows``), and one step
given two different values is an error. Every user error is a one-line ``CurveError``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .common import FitError

LOSS_NAMES = ("loss", "nll", "cross_entropy", "eval_loss", "val_loss", "train_loss",
              "validation_loss", "bits_per_byte", "bpb", "bits_per_token")
PPL_NAMES = ("perplexity", "ppl", "word_perplexity", "token_perplexity", "byte_perplexity")
ID_COLUMNS = ("model", "step", "revision", "tau", "tokens", "n_params")
_STEP_RE = re.compile(r"(?:^|[-_/])(?:step|checkpoint-|global_step)(\d+)(?:$|[-_.])", re.I)


class CurveError(FitError):
    """An external curve file cannot be read or used (one line)."""


@dataclass
class Curve:
    """External curves, one row per (model, step): columns model, step, value, tau and
    n_params (NaN when not given); ``metric`` the source metric's name, ``kind`` loss / perplexity / other."""

    table: pd.DataFrame
    metric: str
    kind: str
    source: str
    task: str | None = None
    flags: list[str] = field(default_factory=list)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(self.table["model"]))


def metric_kind(name: str) -> str:
    """``loss``, ``perplexity`` or ``other`` for a metric name (lm-eval filter suffix ignored)."""
    base = name.split(",")[0].strip().lower()
    if base in PPL_NAMES or base.endswith("perplexity") or base.endswith("_ppl"):
        return "perplexity"
    if base in LOSS_NAMES or base.endswith("_loss"):
        return "loss"
    return "other"


def step_of(revision: object) -> int | None:
    """The step in a revision or folder name (``step1000``, ``checkpoint-1000``,
    ``stage1-step1000-tokens4B``), else None."""
    text = str(revision)
    if text.isdigit():
        return int(text)
    m = _STEP_RE.search(text)
    return int(m.group(1)) if m else None


def read_curve(path: str | os.PathLike, *, metric: str | None = None, task: str | None = None,
               model: str | None = None, allow_metric: bool = False) -> Curve:
    """Read ``path`` (a table file or an lm-eval folder) into a :class:`Curve` (see module doc)."""
    path = Path(path)
    if not path.exists():
        raise CurveError(f"{path}: no such file or folder")
    if path.is_dir():
        raw, metric, task = _read_lm_eval(path, metric, task)
    else:
        raw, metric = _read_table(path, metric)
    if model is not None:
        raw["model"] = model
    kind = metric_kind(metric)
    flags: list[str] = []
    if kind == "other":
        if not allow_metric:
            raise CurveError(
                f"metric {metric!r} is not a loss or a perplexity (accuracy-like metrics do not "
                "follow the loss law); pass allow_metric / --allow-metric to fit it as given, "
                "e.g. an error rate 1 - acc"
            )
        flags.append("not_a_loss")
    table, more = _tidy(raw, path)
    flags += more
    if kind == "perplexity":
        if (table["value"] <= 0).any():
            raise CurveError(f"{path}: a perplexity must be positive; found {table['value'].min()}")
        table["value"] = np.log(table["value"].to_numpy(dtype=float))
        flags.append("from_perplexity")
    return Curve(table=table, metric=metric, kind=kind, source=str(path), task=task, flags=flags)


def _parse_file(path: Path) -> pd.DataFrame:
    """The rows of a CSV / TSV / JSON / JSONL curve file, as they are; one-line errors."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".csv", ".tsv", ".txt"):
            df = pd.read_csv(path, comment="#", sep="\t" if suffix == ".tsv" else ",")
        elif suffix == ".jsonl":
            df = pd.read_json(path, lines=True)
        elif suffix == ".json":
            obj = json.loads(path.read_text())
            if isinstance(obj, dict) and "results" in obj:
                raise CurveError(f"{path} is one lm-eval result file; pass the folder of "
                                 "result files (one per revision) instead")
            if isinstance(obj, dict) and isinstance(obj.get("records"), list):
                obj = obj["records"]
            df = pd.DataFrame(obj)
        else:
            raise CurveError(f"{path}: unknown curve format {suffix!r}; use .csv, .json, "
                             ".jsonl or a folder of lm-eval result JSONs")
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, CurveError):
            raise
        raise CurveError(f"{path}: cannot parse ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if df.empty:
        raise CurveError(f"{path}: no rows")
    return df


def _read_table(path: Path, metric: str | None) -> tuple[pd.DataFrame, str]:
    """(model, step, value, tau, n_params) rows of one metric of a curve file, and the metric."""
    df = _parse_file(path)
    df.columns = [str(c).strip() for c in df.columns]
    if {"metric", "value"} <= set(df.columns):  # long form: pick one metric
        names = list(dict.fromkeys(df["metric"].astype(str)))
        if metric is None:
            metric = _pick(names, path)
        df = df[df["metric"].astype(str) == metric].rename(columns={"value": metric})
        if df.empty:
            raise CurveError(f"{path}: no rows with metric {metric!r}; found {', '.join(names)}")
    if metric is None:
        metric = _pick([c for c in df.columns if c not in ID_COLUMNS and not c.endswith("stderr")],
                       path)
    if metric not in df.columns:
        raise CurveError(f"{path}: no column {metric!r}; columns are {', '.join(df.columns)}")
    df = df.reset_index(drop=True)
    out = pd.DataFrame({"model": df["model"].astype(str) if "model" in df else path.stem},
                       index=df.index)
    if "step" in df:
        out["step"] = df["step"].to_numpy()
    elif "revision" in df:
        out["step"] = [step_of(r) for r in df["revision"]]
    else:
        raise CurveError(f"{path}: needs a 'step' or 'revision' column; columns are "
                         f"{', '.join(df.columns)}")
    out["value"] = pd.to_numeric(df[metric], errors="coerce").to_numpy()
    for col in ("tau", "n_params"):
        out[col] = pd.to_numeric(df[col], errors="coerce").to_numpy() if col in df else np.nan
    return out, metric


def _pick(names: list[str], where: object) -> str:
    """The one loss-like (else perplexity-like) name among ``names``; a lone name otherwise
    (refused later unless allowed)."""
    for kind in ("loss", "perplexity"):
        hits = [n for n in names if metric_kind(n) == kind]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise CurveError(f"{where}: several {kind} metrics ({', '.join(hits)}); choose one "
                             "with metric / --metric")
    if len(names) == 1:
        return names[0]
    raise CurveError(f"{where}: no loss or perplexity metric among {', '.join(map(str, names))}; "
                     "name one with metric / --metric (and allow_metric for other metrics)")


def _model_args(text: object) -> dict[str, str]:
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    out = {}
    for part in str(text or "").split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _model_name(pretrained: str) -> str:
    name = pretrained.rstrip("/").split("/")[-1]
    # Pythia's own evals name the renamed v1.1 models pythia-v1.1-<size>
    return re.sub(r"^pythia-v1\.1-", "pythia-", name)


def _read_lm_eval(folder: Path, metric: str | None, task: str | None
                  ) -> tuple[pd.DataFrame, str, str]:
    files = sorted(p for p in folder.rglob("*.json") if p.is_file())
    docs = []
    for f in files:
        try:
            obj = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            raise CurveError(f"{f}: not valid JSON") from None
        if isinstance(obj, dict) and isinstance(obj.get("results"), dict):
            docs.append((f, obj))
    if not docs:
        raise CurveError(f"{folder}: no lm-eval result JSON (a file with a \"results\" object)")
    tasks = list(dict.fromkeys(t for _, d in docs for t in d["results"]))
    if task is None:
        with_ppl = [t for t in tasks if any(metric_kind(k) == "perplexity"
                                            for _, d in docs for k in d["results"].get(t, {}))]
        if len(with_ppl) != 1:
            raise CurveError(f"{folder}: choose a task with task / --task; tasks with a "
                             f"perplexity: {', '.join(with_ppl) or 'none'}; all: "
                             f"{', '.join(tasks[:12])}{' ...' if len(tasks) > 12 else ''}")
        task = with_ppl[0]
    elif task not in tasks:
        raise CurveError(f"{folder}: no task {task!r}; tasks: {', '.join(tasks[:12])}")
    rows = []
    for f, d in docs:
        res = d["results"].get(task)
        if res is None:
            continue
        keys = {k.split(",")[0]: k for k in res if not k.split(",")[0].endswith("_stderr")
                and k != "alias" and not isinstance(res[k], str)}
        if metric is None:
            metric = _pick(list(keys), f"{folder} task {task}")
        if metric.split(",")[0] not in keys:
            raise CurveError(f"{f}: task {task} has no metric {metric!r}; it has "
                             f"{', '.join(keys)}")
        value = res[keys[metric.split(",")[0]]]
        margs = _model_args((d.get("config") or {}).get("model_args"))
        step = step_of(margs.get("revision", "")) if margs.get("revision") else None
        if step is None:
            step = step_of(f.stem) if step_of(f.stem) is not None else step_of(f.parent.name)
        if step is None:
            raise CurveError(f"{f}: no step: model_args has no revision=step<N> and the file "
                             "name has no step<N>")
        name = margs.get("pretrained") or d.get("model_name") or f.parent.name
        rows.append({"model": _model_name(str(name)), "step": step,
                     "value": float(value) if value is not None else math.nan, "tau": math.nan,
                     "n_params": math.nan})
    return pd.DataFrame(rows), metric.split(",")[0], task


def _tidy(raw: pd.DataFrame, path: Path) -> tuple[pd.DataFrame, list[str]]:
    flags = []
    step = pd.to_numeric(raw["step"], errors="coerce")
    bad = step.isna() | ~np.isfinite(raw["value"].to_numpy(dtype=float))
    if bad.all():
        raise CurveError(f"{path}: no row has both a step and a finite value")
    if bad.any():
        flags.append("dropped_rows")
    df = raw.loc[~bad].copy()
    df["step"] = step[~bad].astype(np.int64)
    if (df["step"] < 0).any():
        raise CurveError(f"{path}: negative step {int(df['step'].min())}")
    dup = df.duplicated(["model", "step"], keep=False)
    if dup.any():
        groups = df[dup].groupby(["model", "step"])["value"]
        spread = groups.max() - groups.min()
        worst = spread.idxmax()
        if spread.max() > 1e-12 * max(1.0, float(df["value"].abs().max())):
            vals = df[dup].set_index(["model", "step"]).loc[[worst], "value"].tolist()
            raise CurveError(f"{path}: model {worst[0]} step {worst[1]} appears "
                             f"{len(vals)} times with different values ({', '.join(map(str, vals))})")
        df = df.drop_duplicates(["model", "step"])
        flags.append("duplicate_rows")
    df = df.sort_values(["model", "step"], kind="stable").reset_index(drop=True)
    return df[["model", "step", "value", "tau", "n_params"]], flags
