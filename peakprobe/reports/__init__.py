"""Rendering a fitted run directory into tables, figures and a self-contained HTML report.

``render_report(run_dir)`` reads ``manifest.json``, ``checkpoints/*.parquet``, ``fits.parquet``,
``fits.json`` and ``integrity.json`` and writes ``RUN/report/``: ``report.html`` (from the jinja2
template in ``templates/``), ``heads.csv``, ``heads.parquet``, ``summary.json`` (schema in
docs/summary_schema.md), ``summary.md`` and ``figures/*.png|svg``. It computes nothing new; it
draws what ``fit`` and ``sweep`` wrote. Never imports torch.
"""

from peakprobe.reports.digest import build_digest
from peakprobe.reports.markdown import digest_markdown
from peakprobe.reports.render import FIGURE_NAMES, ReportPaths, render_report
from peakprobe.reports.tables import (
    HEADS_COLUMNS,
    HEADS_SCHEMA,
    ReportError,
    RunData,
    heads_table,
    load_run,
)

__all__ = [
    "FIGURE_NAMES",
    "HEADS_COLUMNS",
    "HEADS_SCHEMA",
    "ReportError",
    "ReportPaths",
    "RunData",
    "build_digest",
    "heads_table",
    "load_run",
    "render_report",
    "digest_markdown",
]
