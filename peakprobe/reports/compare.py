"""``compare_report``: one self-contained HTML page over several fitted runs or external curves.

Owns: the ``Member`` record (one model of the comparison: its loss curve, loss-law fit and
three-way verdict, bottleneck verdict, per-head growth exponents, window scan), building
members from a fitted run directory or from :mod:`peakprobe.fits.curve` fits, the shared time
axis, and the comparison folder:

``DIR/compare.html``, ``members.csv`` + ``members.json`` (one row / object per member),
``growth.csv`` (every attention head's logit_std exponent, 90% interval, verdict, relative
depth), ``scan.csv`` (the window scans), ``figures/<name>.png|svg``.

A run member reads ``manifest.json``, ``fits.json`` and ``fits.parquet`` (written by ``fit``)
and the LM head's loss from ``checkpoints/*.parquet``; keys missing from ``fits.json`` show as
"—". Its parameter count is, in order: the manifest's ``n_parameters``, the tensor shapes in the
last checkpoint's ``*.safetensors`` headers (exact, no weights read), Pythia's table for a
Pythia model name; else unknown (left out of the size plot). Never imports torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import matplotlib
import numpy as np
import pandas as pd

from peakprobe import results, vocab
from peakprobe.checkpoints_index import PYTHIA_LR_MAX
from peakprobe.checkpoints_index.families import pythia_parameters, pythia_size
from peakprobe.config import check_band
from peakprobe.fits.curve import CurveFit, CurveResult, window_scan
from peakprobe.fits.third import judge_third
from peakprobe.formatting import num
from peakprobe.reports import compare_figures as CF
from peakprobe.reports.figures import RC
from peakprobe.reports.tables import ReportError
from peakprobe.vocab import BAND

TEMPLATES = Path(__file__).parent / "templates"
FIGURES = ("loss_overlay", "reducible", "exponent_vs_size", "growth_vs_depth", "window_scan")
GROWTH_COLUMNS = ["member", "layer", "head", "n_layers", "rel_depth", "alpha", "alpha_lo",
                  "alpha_hi", "verdict", "site_class"]
SCAN_COLUMNS = ["member", "t_min_step", "t_min", "n_points", "alpha", "alpha_lo", "alpha_hi",
                "verdict", "drift"]


@dataclass
class Member:
    """One model of a comparison (see the module docstring)."""

    name: str
    source: str
    kind: str  # "run" or "curve"
    n_params: float | None
    n_params_from: str
    time_axis: str  # "tau" or "step"
    lr_max: float | None
    steps: np.ndarray  # (T,)
    t: np.ndarray  # (T,)
    loss: np.ndarray  # (T,)
    in_window: np.ndarray  # (T,) bool
    alpha: float = math.nan
    alpha_lo: float = math.nan
    alpha_hi: float = math.nan
    L0: float = math.nan
    c: float = math.nan
    n_points: int = 0
    verdict: str = ""
    flags: list[str] = field(default_factory=list)
    bottleneck: dict | None = None
    growth: pd.DataFrame | None = None
    scan: pd.DataFrame | None = None
    x: np.ndarray | None = None  # the shared plotting axis, set by `shared_axis`
    x_scale: float = 1.0  # fit time = x / x_scale (NaN: the fit's axis is not the shared one)


def _nan(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def safetensors_parameters(folder: Path) -> int | None:
    """Elements in every tensor of ``folder/*.safetensors``, from the headers only."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def _parameters(manifest: dict) -> tuple[float | None, str]:
    for key in ("n_parameters", "n_params"):
        if manifest.get(key):
            return float(manifest[key]), "manifest"
    last = (manifest.get("checkpoints") or [{}])[-1]
    if last.get("path") and Path(last["path"]).is_dir():
        n = safetensors_parameters(Path(last["path"]))
        if n:
            return float(n), "safetensors"
    for name in (manifest.get("model"), manifest.get("source")):
        size = pythia_size(str(name or ""))
        if size:
            return float(pythia_parameters(size)), "pythia table"
    return None, ""


def _lr_max(manifest: dict) -> float | None:
    lr = (manifest.get("schedule") or {}).get("lr_max")
    if lr:
        return float(lr)
    for name in (manifest.get("model"), manifest.get("source")):
        size = pythia_size(str(name or ""))
        if size:
            return PYTHIA_LR_MAX[size]
    return None


def _loss_rows(run_dir: Path) -> pd.DataFrame:
    if not any((run_dir / results.CHECKPOINTS).glob("*.parquet")):
        return pd.DataFrame(columns=["step", "tau", "value"])
    df = results.read_results(run_dir)
    df = df[(df["site_kind"] == vocab.LM_HEAD) & (df["metric"] == vocab.LOSS)][["step", "tau", "value"]]
    return df.sort_values("step", kind="stable").drop_duplicates("step")


def member_from_run(run_dir: str | os.PathLike, *, band: tuple[float, float] = BAND,
                    n_boot: int = 1000, seed: int = 0, scan: bool = True) -> Member:
    """A member from a fitted run directory (``fit`` must have run)."""
    run_dir = Path(run_dir)
    manifest = results.read_manifest(run_dir)
    if not (run_dir / results.FITS).exists():
        raise ReportError(f"{run_dir} has no {results.FITS}; run `peakprobe fit {run_dir}` first")
    fits = results.read_fits(run_dir)
    verdicts = results.read_fits_json(run_dir) if (run_dir / results.FITS_JSON).exists() else {}
    name = str(manifest.get("model") or run_dir.name)
    n_params, from_ = _parameters(manifest)
    loss_fit = fits[fits["fit"] == vocab.FIT_LOSS]
    rows = _loss_rows(run_dir)
    axis = str(loss_fit["time_axis"].iloc[0]) if len(loss_fit) else str(verdicts.get("time_axis", "step"))
    steps = rows["step"].to_numpy(dtype=np.int64)
    t = rows["tau"].to_numpy(dtype=float) if axis == "tau" else steps.astype(float)
    loss = rows["value"].to_numpy(dtype=float)
    keep = t > 0
    steps, t, loss = steps[keep], t[keep], loss[keep]
    m = Member(name=name, source=str(run_dir), kind="run", n_params=n_params, n_params_from=from_,
               time_axis=axis, lr_max=_lr_max(manifest), steps=steps, t=t, loss=loss,
               in_window=np.zeros(len(t), dtype=bool), bottleneck=verdicts.get("bottleneck"),
               flags=[str(f) for f in verdicts.get("flags", [])])
    if len(loss_fit):
        r = loss_fit.iloc[0]
        m.in_window = (t >= r["t_min"] * (1 - 1e-12)) & (t <= r["t_max"] * (1 + 1e-12))
        m.alpha, m.alpha_lo, m.alpha_hi = _nan(r["alpha"]), _nan(r["alpha_lo"]), _nan(r["alpha_hi"])
        m.L0, m.c, m.n_points = _nan(r["L0"]), _nan(r["c"]), int(r["n_points"])
        m.verdict = judge_third(m.alpha_lo, m.alpha_hi, band)
        if scan and m.in_window.sum() >= 5 and np.isfinite(m.alpha_lo):
            w = m.in_window
            m.scan = window_scan(name, t[w], loss[w], steps[w], (m.alpha_lo, m.alpha_hi),
                                 n_boot=n_boot, seed=seed, band=band).rename(columns={"model": "member"})
            if m.scan["drift"].any():
                m.flags.append("window_drift")
    else:
        m.flags.append("no_loss_fit")
    g = fits[(fits["fit"] == vocab.FIT_GROWTH) & (fits["metric"] == vocab.LOGIT_STD) & (fits["site_kind"] == "attn")]
    if len(g):
        n_layers = int(g["layer"].max()) + 1
        m.growth = pd.DataFrame({
            "member": name, "layer": g["layer"].to_numpy(), "head": g["head"].to_numpy(),
            "n_layers": n_layers, "rel_depth": (g["layer"].to_numpy() + 1) / n_layers,
            "alpha": g["alpha"].to_numpy(dtype=float), "alpha_lo": g["alpha_lo"].to_numpy(dtype=float),
            "alpha_hi": g["alpha_hi"].to_numpy(dtype=float),
            "verdict": [judge_third(lo, hi, band) for lo, hi in zip(g["alpha_lo"], g["alpha_hi"], strict=True)],
            "site_class": g["site_class"].to_numpy(),
        })
    return m


def member_from_curve(fit: CurveFit, source: str) -> Member:
    """A member from one model of an external curve (``fits.curve``)."""
    lf = fit.fit
    scan = fit.scan.rename(columns={"model": "member"}) if len(fit.scan) else None
    return Member(
        name=fit.model, source=source, kind="curve", n_params=fit.n_params,
        n_params_from=fit.n_params_from,
        time_axis=fit.time_axis, lr_max=fit.lr_max, steps=fit.steps, t=fit.t, loss=fit.loss,
        in_window=fit.in_window, alpha=lf.alpha, alpha_lo=lf.alpha_lo, alpha_hi=lf.alpha_hi,
        L0=lf.L0, c=lf.c, n_points=lf.n_points, verdict=fit.verdict, flags=list(fit.flags),
        scan=scan,
    )


def shared_axis(members: list[Member]) -> str:
    """Set every member's plotting axis x; returns its label: tau·lr_max when every member has
    tau and lr_max, else tau when all have tau, else step."""
    if all(m.time_axis == "tau" and m.lr_max for m in members):
        for m in members:
            m.x, m.x_scale = m.t * m.lr_max, float(m.lr_max)
        return "tau·lr_max"
    if all(m.time_axis == "tau" for m in members):
        for m in members:
            m.x, m.x_scale = m.t, 1.0
        return "tau"
    for m in members:
        m.x = m.steps.astype(float)
        m.x_scale = 1.0 if m.time_axis == "step" else math.nan
    return "step"


KIND_KEYS = ("share", "share_lo", "share_hi", "alpha_gain", "alpha_gain_lo", "alpha_gain_hi",
             "gain_verdict")


def _kind_columns(b: dict) -> dict:
    """fits.json format 2: per softmax kind, its share of the loss decrease and its gain's decay exponent
    (columns attn_* and lm_*; None where the run's fits.json has no such key)."""
    kinds = b.get("kinds") if isinstance(b.get("kinds"), dict) else {}
    out = {}
    for kind, prefix in (("attention", "attn"), ("lm_head", "lm")):
        block = kinds.get(kind) if isinstance(kinds.get(kind), dict) else {}
        out.update({f"{prefix}_{k}": block.get(k) for k in KIND_KEYS})
    return out


def members_table(members: list[Member]) -> pd.DataFrame:
    rows = []
    for m in members:
        b = m.bottleneck or {}
        w = m.in_window
        rows.append({
            "member": m.name, "kind": m.kind, "source": m.source, "n_params": m.n_params,
            "n_params_from": m.n_params_from, "time_axis": m.time_axis, "lr_max": m.lr_max,
            "t_min_step": int(m.steps[w][0]) if w.any() else None,
            "t_max_step": int(m.steps[w][-1]) if w.any() else None,
            "window": f"{int(m.steps[w][0])}–{int(m.steps[w][-1])}" if w.any() else "—",
            "n_points": m.n_points,
            "alpha": m.alpha, "alpha_lo": m.alpha_lo, "alpha_hi": m.alpha_hi, "verdict": m.verdict,
            "L0": m.L0, "final_loss": float(m.loss[-1]) if len(m.loss) else math.nan,
            "bottleneck": b.get("verdict", ""), "bottleneck_reason": b.get("reason", ""),
            "n_concentrating": b.get("n_concentrating"), "n_saturated": b.get("n_saturated"),
            "n_diffuse": b.get("n_diffuse"), "lm_head_alpha": b.get("lm_head_alpha"),
            "attn_alpha_median": b.get("attn_alpha_median"), "n_peaked": b.get("n_peaked"),
            **_kind_columns(b), "flags": ";".join(m.flags),
        })
    return pd.DataFrame(rows)


def _params(x) -> str:
    """A parameter count as 70.4M / 1.41B; an em dash when unknown."""
    v = _nan(x)
    if math.isnan(v):
        return "—"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"


@dataclass(frozen=True)
class ComparePaths:
    """The files one ``compare_report`` call wrote."""

    out_dir: Path
    html: Path
    members_csv: Path
    members_json: Path
    growth_csv: Path
    scan_csv: Path
    figures: tuple[Path, ...]


def compare_report(members: list[Member], out_dir: str | os.PathLike, *,
                   band: tuple[float, float] = BAND, command: str | None = None,
                   failed: dict[str, str] | None = None, title: str | None = None) -> ComparePaths:
    """Write the comparison folder for ``members`` (see the module docstring)."""
    band = check_band(band)
    if not members:
        raise ReportError("nothing to compare: no member has a loss curve")
    names = [m.name for m in members]
    if len(set(names)) < len(names):  # two runs of one model (seeds): tell them apart
        for m in members:
            if names.count(m.name) > 1:
                m.name = f"{m.name} ({Path(m.source).name})"
    out = Path(out_dir)
    members = sorted(members, key=lambda m: (m.n_params is None, m.n_params or 0.0))
    x_label = shared_axis(members)
    table = members_table(members)
    growth = pd.concat([m.growth for m in members if m.growth is not None] or
                       [pd.DataFrame(columns=GROWTH_COLUMNS)], ignore_index=True)[GROWTH_COLUMNS]
    scan = pd.concat([m.scan for m in members if m.scan is not None and len(m.scan)] or
                     [pd.DataFrame(columns=SCAN_COLUMNS)], ignore_index=True)[SCAN_COLUMNS]
    results.write_bytes(out / "members.csv", table.to_csv(index=False, lineterminator="\n").encode())
    results.write_bytes(out / "growth.csv", growth.to_csv(index=False, lineterminator="\n").encode())
    results.write_bytes(out / "scan.csv", scan.to_csv(index=False, lineterminator="\n").encode())
    summary = {"format": 1, "band": list(band), "x_axis": x_label,
               "members": table.to_dict(orient="records"), "failed": failed or {}}
    results.write_json(out / "members.json", summary)

    names = [m.name for m in members]
    with matplotlib.rc_context(RC):
        drawn = [CF.loss_overlay(members, x_label), CF.reducible(members, x_label),
                 CF.exponent_vs_size(members, band), CF.growth_vs_depth(growth, names, band),
                 CF.window_scan(scan, names, band)]
    figs = {f.name: f for f in drawn if f is not None}
    fig_paths = []
    for name in FIGURES:
        for ext in ("png", "svg"):
            p = out / "figures" / f"{name}.{ext}"
            if name in figs:
                results.write_bytes(p, getattr(figs[name], ext))
                fig_paths.append(p)
            else:
                p.unlink(missing_ok=True)

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["num"] = num
    env.filters["params"] = _params
    page = env.get_template("compare.html").render(
        title=title or f"peakprobe comparison: {len(members)} members",
        members=members, table=_records(table), band=band, x_label=x_label,
        figures=[figs[n] for n in FIGURES if n in figs], data_uri=_data_uri,
        growth_summary=_growth_summary(growth), scan=scan.to_dict(orient="records"),
        has_gains=bool(table[["attn_share", "lm_share"]].notna().to_numpy().any()),
        has_v1=bool(table[["lm_head_alpha", "attn_alpha_median"]].notna().to_numpy().any()),
        failed=failed or {}, command=command or "not recorded",
        generated_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    )
    results.write_bytes(out / "compare.html", page.encode())
    return ComparePaths(out, out / "compare.html", out / "members.csv", out / "members.json",
                        out / "growth.csv", out / "scan.csv", tuple(fig_paths))


def _records(table: pd.DataFrame) -> list[dict]:
    """Rows for the template, with NaN as None (so ``or`` and ``is none`` work in jinja)."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in table.to_dict(orient="records")]


def _data_uri(svg: bytes) -> str:
    import base64

    return "data:image/svg+xml;base64," + base64.b64encode(svg).decode("ascii")


def _growth_summary(growth: pd.DataFrame) -> list[dict]:
    """Per member: heads fitted, median exponent, and how many heads each verdict got."""
    out = []
    for name, g in growth.groupby("member", sort=False):
        counts = g["verdict"].value_counts()
        out.append({"member": name, "n_heads": len(g), "n_layers": int(g["n_layers"].iloc[0]),
                    "median": float(g["alpha"].median()),
                    "consistent": int(counts.get("consistent", 0)),
                    "inconsistent": int(counts.get("inconsistent", 0)),
                    "inconclusive": int(counts.get("inconclusive", 0))})
    return out


def members_from_curves(result: CurveResult) -> list[Member]:
    return [member_from_curve(f, result.curve.source) for f in result.fits]
