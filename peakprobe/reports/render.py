"""``render_report``: turn a fitted run directory into ``RUN/report/``.

Owns: the order of the rendering steps, the file layout of the report folder and the
``ReportPaths`` record. Writes ``heads.csv``, ``heads.parquet``, ``summary.json``, ``summary.md``,
``figures/<name>.png|svg`` and ``report.html``, each atomically. Everything is byte-identical for
the same run except report.html's two provenance lines (the command and the time).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import pandas as pd
from tqdm.auto import tqdm

from peakprobe import vocab
from peakprobe.reports import figures as F
from peakprobe.reports import science
from peakprobe.reports.digest import build_digest
from peakprobe.reports.html import render_html
from peakprobe.reports.markdown import digest_markdown
from peakprobe.reports.routers import router_series, router_table
from peakprobe.reports.tables import (
    HEADS_SCHEMA,
    curve_sites,
    growth_curve,
    heads_table,
    load_run,
    logit_max_series,
    loss_curve,
    sensitivity_ranking,
)
from peakprobe.results import REPORT, table_bytes, write_bytes, write_json
from peakprobe.vocab import LM_HEAD

FIGURE_NAMES = (
    "alpha_heatmap",
    "peaked_entropy_heatmap",
    "peaked_heatmap",
    "growth_curves",
    "loss_curve",
    "gain_curves",
    "window_scan",
    "sensitivity",
    "logit_max_curves",
    "router_curves",
)
CURVE_HEADS = 6  # attention heads drawn in the growth panels (plus the LM head)


@dataclass(frozen=True)
class ReportPaths:
    """The files one ``render_report`` call wrote."""

    out_dir: Path
    html: Path
    heads_csv: Path
    heads_parquet: Path
    summary_json: Path
    summary_md: Path
    figures_png: tuple[Path, ...]
    figures_svg: tuple[Path, ...]

    def all(self) -> tuple[Path, ...]:
        """Every written file, report.html first."""
        return (
            self.html,
            self.heads_csv,
            self.heads_parquet,
            self.summary_json,
            self.summary_md,
            *self.figures_png,
            *self.figures_svg,
        )


def heads_csv_bytes(heads: pd.DataFrame) -> bytes:
    """heads.csv: header + one row per site, full float precision, '\\n' line ends, empty for NaN."""
    return heads.to_csv(index=False, lineterminator="\n").encode()


def _draw_figures(run, heads: pd.DataFrame, summary: dict, steps) -> dict[str, F.RenderedFigure]:
    """Every figure the run has data for, by name (the digest ``summary`` decides what the gain
    and window-scan figures show; its figure list is filled in after)."""
    with matplotlib.rc_context(F.RC):
        drawn = [
            F.alpha_heatmap(heads),
            F.peaked_heatmap(heads, run.last_revision, "entropy"),
            F.peaked_heatmap(heads, run.last_revision, vocab.LOGIT_STD),
        ]
        steps.update()
        sites, how = curve_sites(run, heads, CURVE_HEADS)
        curves = [growth_curve(run, *site) for site in sites]
        if (heads["site_kind"] == LM_HEAD).any():
            curves.append(growth_curve(run, LM_HEAD, -1, -1))
        drawn += [
            F.growth_panels(curves, run.time_axis, how),
            F.loss_figure(loss_curve(run), run.time_axis),
        ]
        steps.update()
        gains = [science.gain_curve(run, *site) for site in science.gain_sites(run)]
        drawn += [
            F.gain_figure(gains, run.time_axis),
            F.window_scan_figure(summary["window_scan"]["rows"], tuple(summary["band"]), run.time_axis),
            F.sensitivity_figure(sensitivity_ranking(heads)),
            F.logit_max_figure(logit_max_series(run), run.time_axis),
            F.router_figure(router_series(run), router_table(run), run.time_axis),
        ]
        steps.update()
    return {fig.name: fig for fig in drawn if fig is not None}


def _write_figures(fig_dir: Path, rendered: dict[str, F.RenderedFigure]) -> tuple[list[Path], list[Path]]:
    """Write each drawn figure as PNG and SVG; remove those an earlier render drew but this run
    has no data for. Returns (PNG paths, SVG paths)."""
    png_paths, svg_paths = [], []
    for name in FIGURE_NAMES:
        png, svg = fig_dir / f"{name}.png", fig_dir / f"{name}.svg"
        if name in rendered:
            write_bytes(png, rendered[name].png)
            write_bytes(svg, rendered[name].svg)
            png_paths.append(png)
            svg_paths.append(svg)
        else:
            png.unlink(missing_ok=True)
            svg.unlink(missing_ok=True)
    return png_paths, svg_paths


def render_report(
    run_dir: str | os.PathLike,
    *,
    out_dir: str | os.PathLike | None = None,
    command: str | None = None,
    progress: bool = False,
) -> ReportPaths:
    """Render ``run_dir`` (after ``fit``) into ``out_dir`` (default ``run_dir/report``).

    ``command`` is the command line shown in the HTML provenance (HTML only). Raises
    ``ReportError`` / ``RunDirError`` (both ``ValueError``) when the run cannot be reported.
    """
    steps = tqdm(total=7, desc="report", unit="step", disable=not progress)
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT
    steps.update()

    heads = heads_table(run)
    write_bytes(out / "heads.csv", heads_csv_bytes(heads))
    write_bytes(out / "heads.parquet", table_bytes(heads, HEADS_SCHEMA))
    steps.update()

    summary = build_digest(run, heads, [])
    rendered = _draw_figures(run, heads, summary, steps)
    png_paths, svg_paths = _write_figures(out / "figures", rendered)
    summary["figures"] = sorted(rendered)
    write_json(out / "summary.json", summary)
    write_bytes(out / "summary.md", digest_markdown(summary).encode())
    steps.update()

    software = {
        "python": platform.python_version(),
        "pandas": pd.__version__,
        "matplotlib": matplotlib.__version__,
    }
    generated_at = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    page = render_html(
        run, heads, summary, rendered, command=command, generated_at=generated_at, software=software
    )
    write_bytes(out / "report.html", page.encode())
    steps.update()
    steps.close()
    return ReportPaths(
        out,
        out / "report.html",
        out / "heads.csv",
        out / "heads.parquet",
        out / "summary.json",
        out / "summary.md",
        tuple(png_paths),
        tuple(svg_paths),
    )
