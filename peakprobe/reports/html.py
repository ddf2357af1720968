"""The self-contained ``report.html``: verdicts, figures, sensitivity, sortable per-head table, provenance.

Owns: the page's markup, its inline CSS and its small inline sorting script. Figures arrive as
SVG bytes and are embedded as base64 ``data:`` URIs, so the file opens from disk with no network.
Every piece of text that comes from the run (model, source, revisions, paths, reasons, flags,
the command) goes through ``html.escape``; nothing user-provided is ever placed unescaped.
"""

from __future__ import annotations

import base64
import html
import math
from typing import Any

import numpy as np
import pandas as pd

from peakprobe.reports.figures import RenderedFigure
from peakprobe.reports.summary import relation_text
from peakprobe.reports.tables import RunData, sensitivity_ranking, site_label

MAX_RANKED_ROWS = 20
MAX_LISTED_REVISIONS = 400

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1200px;padding:0 1.2em 3em;color:#222;line-height:1.45}
h1{font-size:1.5em;margin:1em 0 .2em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.sub{color:#666;margin:0 0 1em}
.cards{display:flex;flex-wrap:wrap;gap:1em}.card{flex:1 1 320px;border:1px solid #ddd;border-radius:6px;padding:.7em 1em;background:#fafafa}
.card b.big{font-size:1.25em}.ok{color:#1a7f37}.warn{color:#b35900}
figure{margin:1em 0}.row{display:flex;flex-wrap:wrap;gap:0 1.5em}.row figure{flex:1 1 420px}figure img{max-width:100%;height:auto;border:1px solid #eee}figcaption{color:#555;font-size:.9em;max-width:900px}
table{border-collapse:collapse;font-size:.85em}th,td{padding:2px 8px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th{background:#f3f3f3;position:sticky;top:0}td.t,th.t{text-align:left}
table.sortable th{cursor:pointer;user-select:none}table.sortable th[aria-sort=ascending]::after{content:" \\25B2"}
table.sortable th[aria-sort=descending]::after{content:" \\25BC"}
.scroll{max-height:70vh;overflow:auto;border:1px solid #ddd}
dl.prov{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dl.prov dt{font-weight:600}dl.prov dd{margin:0;word-break:break-all}
code{font-size:.9em}
"""

# Numeric-aware sorting: numeric columns (th.num) start descending, text columns ascending;
# a second click reverses; cells without a number (em dash) always go last; ties keep order.
SCRIPT = """
(function(){
  function key(cell, numeric){
    var raw = cell.hasAttribute('data-v') ? cell.getAttribute('data-v') : cell.textContent;
    if (!numeric) return raw;
    var x = parseFloat(raw);
    return isNaN(x) ? null : x;
  }
  function sortBy(table, col, th){
    var numeric = th.classList.contains('num');
    var now = th.getAttribute('aria-sort');
    var asc = now ? now === 'descending' : !numeric;
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var keyed = rows.map(function(r, i){ return {row: r, k: key(r.cells[col], numeric), i: i}; });
    keyed.sort(function(a, b){
      if (a.k === null || b.k === null) {
        if (a.k === b.k) return a.i - b.i;
        return a.k === null ? 1 : -1;
      }
      var c = numeric ? a.k - b.k : String(a.k).localeCompare(String(b.k));
      if (c === 0) return a.i - b.i;
      return asc ? c : -c;
    });
    var frag = document.createDocumentFragment();
    keyed.forEach(function(e){ frag.appendChild(e.row); });
    body.appendChild(frag);
    Array.prototype.forEach.call(th.parentNode.cells, function(h){ h.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', asc ? 'ascending' : 'descending');
  }
  document.querySelectorAll('table.sortable').forEach(function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function(th, col){
      th.addEventListener('click', function(){ sortBy(table, col, th); });
    });
  });
})();
"""

E = html.escape


def _num(x: Any, digits: int = 4) -> str:
    """A finite number with ``digits`` significant digits, else an em dash."""
    if x is None:
        return "—"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return E(str(x))
    return f"{v:.{digits}g}" if math.isfinite(v) else "—"


def _ci(alpha: Any, lo: Any, hi: Any) -> str:
    return f"{_num(alpha, 3)} [{_num(lo, 3)}, {_num(hi, 3)}]"


def _figure(fig: RenderedFigure) -> str:
    data = base64.b64encode(fig.svg).decode("ascii")
    return (
        f'<figure id="fig-{fig.name}"><img src="data:image/svg+xml;base64,{data}" alt="{E(fig.title)}">'
        f"<figcaption><b>{E(fig.title)}.</b> {E(fig.caption)}</figcaption></figure>"
    )


def _verdict_cards(summary: dict) -> str:
    loss = summary["loss"]
    if loss is None:
        loss_html = "<b class=big>No loss fit</b><p>The run has no LM loss or fit skipped it.</p>"
    else:
        cls = "ok" if loss["relation"] == "consistent" else "warn"
        loss_html = (
            f"<b class=big>α = {_ci(loss['alpha'], loss['alpha_lo'], loss['alpha_hi'])}</b>"
            f"<p class={cls}>Loss exponent (90% CI) vs 1/3: {E(relation_text(loss['relation']))}.</p>"
            f"<p>L = L0 + c·t<sup>−α</sup>, L0 = {_num(loss['L0'], 3)}, R² = {_num(loss['r2'], 3)}, "
            f"{_num(loss['n_points'])} checkpoints.</p>"
        )
    b = summary["bottleneck"]
    names = {
        "attention": "Attention heads are the bottleneck",
        "lm_head": "The LM head is the bottleneck",
    }
    verdict = b["verdict"]
    title = names.get(verdict, f"Bottleneck: {verdict}" if verdict else "Bottleneck undetermined")
    bott_html = (
        f"<b class=big>{E(title)}</b>"
        + (f"<p>{E(str(b['reason']))}</p>" if b["reason"] else "")
        + f"<p>{_num(b['n_concentrating'])} concentrating, {_num(b['n_saturated'])} saturated, "
        f"{_num(b['n_diffuse'])} diffuse heads; median attention α {_num(b['attn_alpha_median'], 3)}, "
        f"LM head α {_num(b['lm_head_alpha'], 3)}.</p>"
    )
    flags = summary["flags"] + (loss["flags"] if loss else [])
    flag_html = f"<p class=warn>Flags: {E(', '.join(flags))}</p>" if flags else ""
    return (
        f'<section id="verdict"><h2>Verdict</h2><div class=cards><div class=card id="loss-verdict">{loss_html}</div>'
        f'<div class=card id="bottleneck-verdict">{bott_html}</div></div>{flag_html}</section>'
    )


def _sensitivity(heads: pd.DataFrame, fig: RenderedFigure | None) -> str:
    ranking = sensitivity_ranking(heads)
    if ranking.empty:
        return (
            '<section id="sensitivity"><h2>Sensitivity ranking</h2><p id="sensitivity-missing">Not measured: '
            "this run's sweep did not record d loss / d log β (re-run the sweep with sensitivity on).</p></section>"
        )
    rows = "".join(
        f"<tr><td>{i + 1}</td><td class=t>{E(site_label(r.site_kind, r.layer, r.head))}</td><td>{_num(r.sensitivity)}</td>"
        f"<td>{_num(r.alpha, 3)}</td><td class=t>{E(r.site_class) or '—'}</td></tr>"
        for i, r in enumerate(ranking.head(MAX_RANKED_ROWS).itertuples())
    )
    table = (
        '<table id="sensitivity-table"><thead><tr><th>rank</th><th class=t>site</th><th>d loss / d log β</th>'
        f"<th>α</th><th class=t>class</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    return (
        f'<section id="sensitivity"><h2>Sensitivity ranking</h2>{_figure(fig) if fig else ""}'
        f"<p>Top {min(len(ranking), MAX_RANKED_ROWS)} of {len(ranking)} sites, most negative first "
        f"(scaling that softmax's logits up lowers the loss fastest).</p>{table}</section>"
    )


HEAD_COLUMNS = (  # (header, heads column or None, numeric)
    ("layer", "layer", True),
    ("head", "head", True),
    ("class", "site_class", False),
    ("α [90% CI]", "alpha", True),
    ("R²", "r2", True),
    ("final entropy", "final_entropy", True),
    ("max_prob", "final_max_prob", True),
    ("logit_std", "final_logit_std", True),
    ("peaked", "final_peaked", True),
    ("first_key_prob", "final_first_key_prob", True),
    ("sensitivity", "sensitivity", True),
)


def _heads_table(heads: pd.DataFrame, last_revision: str) -> str:
    with_sens = bool(np.isfinite(heads["sensitivity"]).any())
    cols = [c for c in HEAD_COLUMNS if with_sens or c[1] != "sensitivity"]
    head_html = "".join(
        f'<th class="{"num" if num else "t"}" title="click to sort">{E(name)}</th>'
        for name, _, num in cols
    )
    body = []
    for r in heads.itertuples(index=False):
        cells = []
        for _, col, _num_col in cols:
            v = getattr(r, col)
            if col == "layer":
                cells.append("<td>LM</td>" if r.site_kind == "lm_head" else f"<td>{int(v)}</td>")
            elif col == "head":
                cells.append("<td>—</td>" if r.site_kind == "lm_head" else f"<td>{int(v)}</td>")
            elif col == "site_class":
                cells.append(f"<td class=t>{E(str(v)) or '—'}</td>")
            elif col == "alpha":
                dv = f' data-v="{float(v)!r}"' if np.isfinite(v) else ""
                cells.append(f"<td{dv}>{_ci(v, r.alpha_lo, r.alpha_hi)}</td>")
            else:
                cells.append(f"<td>{_num(v)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<section id="heads"><h2>Per-head table</h2>'
        f"<p>One row per softmax site; final columns are the last checkpoint ({E(last_revision)}); "
        "peaked = fraction of rows with logit_std &gt; sqrt(2 ln n). Click a header to sort.</p>"
        f'<div class=scroll><table class="sortable" id="heads-table"><thead><tr>{head_html}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div></section>"
    )


def _provenance(
    run: RunData, summary: dict, command: str | None, generated_at: str, software: dict
) -> str:
    m = run.manifest
    res = run.results.drop_duplicates("revision")
    revs = [f"{rev} (step {step})" for rev, step in zip(res["revision"], res["step"], strict=True)]
    shown = ", ".join(revs[:MAX_LISTED_REVISIONS]) + (
        " …" if len(revs) > MAX_LISTED_REVISIONS else ""
    )
    data = m.get("data") or {}
    items = [
        ("model", m.get("model")),
        ("source", m.get("source")),
        ("run directory", str(run.run_dir)),
        (
            "checkpoints",
            f"{len(revs)} finished of {len(m.get('checkpoints') or [])} planned, "
            f"{len(run.failures)} failed; time axis {run.time_axis}",
        ),
        (
            "data",
            f"{data.get('spec')} — {data.get('n_windows')} windows × {data.get('window')} tokens",
        ),
        ("data hash", data.get("token_hash")),
        ("probe", ", ".join(f"{k}={v}" for k, v in sorted((m.get("probe") or {}).items()))),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items()))),
        ("report software", ", ".join(f"{k} {v}" for k, v in sorted(software.items()))),
        ("command", command if command else "not recorded"),
        ("generated", generated_at),
    ]
    dl = "".join(f"<dt>{E(k)}</dt><dd>{E(str(v))}</dd>" for k, v in items)
    fails = "".join(
        f"<li>{E(str(f.get('revision', '?')))}: {E(str(f.get('error', '')))}</li>"
        for f in run.failures
    )
    fails_html = f"<p>Failed checkpoints:</p><ul>{fails}</ul>" if fails else ""
    return (
        f'<section id="provenance"><h2>Provenance</h2><dl class=prov>{dl}</dl>'
        f"<details><summary>Revisions ({len(revs)})</summary><p>{E(shown)}</p></details>{fails_html}</section>"
    )


def render_html(
    run: RunData,
    heads: pd.DataFrame,
    summary: dict,
    figures: dict[str, RenderedFigure],
    *,
    command: str | None,
    generated_at: str,
    software: dict[str, str],
) -> str:
    """The whole report page as one string (UTF-8, no external resource)."""
    model = str(run.manifest.get("model", "?"))
    figs = [_figure(figures[n]) for n in ("alpha_heatmap", "peaked_heatmap") if n in figures]
    heat = (
        f"<div class=row>{''.join(figs)}</div>"
        if figs
        else "<p>No attention head has a growth fit.</p>"
    )
    growth = (
        _figure(figures["growth_curves"])
        if "growth_curves" in figures
        else "<p>No growth curve to draw.</p>"
    )
    loss = (
        _figure(figures["loss_curve"])
        if "loss_curve" in figures
        else '<p id="loss-missing">No loss was measured in this run.</p>'
    )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>peakprobe report: {E(model)}</title><style>{CSS}</style></head><body>"
        f'<h1>peakprobe report: <span id="model-name">{E(model)}</span></h1>'
        f"<p class=sub>{E(str(run.manifest.get('source', '')))} · {summary['checkpoints']['n']} checkpoints · "
        f"time axis {E(run.time_axis)}</p>"
        f"{_verdict_cards(summary)}"
        f'<section id="heatmaps"><h2>Heads at a glance</h2>{heat}</section>'
        f'<section id="growth"><h2>Logit growth</h2>{growth}</section>'
        f'<section id="loss"><h2>Loss</h2>{loss}</section>'
        f"{_sensitivity(heads, figures.get('sensitivity'))}"
        f"{_heads_table(heads, run.last_revision)}"
        f"{_provenance(run, summary, command, generated_at, software)}"
        f"<script>{SCRIPT}</script></body></html>\n"
    )
