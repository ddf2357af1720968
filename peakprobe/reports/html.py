"""The self-contained ``report.html``, rendered from the jinja2 template ``templates/report.html.j2``.

Owns: the jinja2 environment of the report (autoescape on, strict undefined, number filters), the
view of the per-head table and the provenance, and the inline CSS / sorting script read from
``templates/``. Every value from the run (model, source, revisions, paths, reasons, flags, the
command) reaches the page through an autoescaped template expression; only the CSS, the script
and the figures' base64 ``data:`` URIs, all made by this package, are marked safe. The page loads
nothing: no link, no external script, no font. Everything but the provenance lines holding the
command and the time is the same bytes for the same run.
"""

from __future__ import annotations

import base64
import math

import numpy as np
import pandas as pd
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from peakprobe import vocab
from peakprobe.formatting import num, pct
from peakprobe.reports.figures import RenderedFigure
from peakprobe.reports.markdown import dup_text, heads_line
from peakprobe.reports.tables import RunData, sensitivity_ranking
from peakprobe.vocab import INTEGRITY, LM_HEAD, PEAKED_ENTROPY, site_label

MAX_RANKED_ROWS = 20
MAX_LISTED_REVISIONS = 400
TEMPLATE = "report.html.j2"


def environment() -> Environment:
    """The report's jinja2 environment: package templates, autoescape, strict undefined."""
    env = Environment(
        loader=PackageLoader("peakprobe.reports", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["num"] = lambda x, digits=4: num(x, f".{digits}g")
    env.filters["pct"] = pct
    env.filters["yes"] = lambda x: {True: "yes", False: "no"}.get(x, "—")
    env.filters["site"] = lambda t: site_label(
        t["site_kind"], -1 if t["layer"] is None else t["layer"], -1 if t["head"] is None else t["head"]
    )
    env.filters["dup"] = dup_text
    return env


ENV = environment()


def _raw(name: str) -> Markup:
    """A template file's text as is (CSS, JS): package-made, never rendered, never escaped."""
    source, _, _ = ENV.loader.get_source(ENV, name)
    return Markup(source)


def _figure_view(fig: RenderedFigure) -> dict:
    uri = "data:image/svg+xml;base64," + base64.b64encode(fig.svg).decode("ascii")
    return {"name": fig.name, "title": fig.title, "caption": fig.caption, "uri": Markup(uri)}


# (header, heads column, numeric); columns of metrics no site measured are left out
HEAD_COLUMNS = (
    ("layer", "layer", True),
    ("head", "head", True),
    ("class", "site_class", False),
    ("α [90% CI]", "alpha", True),
    ("R²", "r2", True),
    ("vs 1/3", "verdict", False),
    ("gain share", "share", True),
    ("gain α", "gain_alpha", True),
    ("final entropy", "final_entropy", True),
    (vocab.MAX_PROB, "final_max_prob", True),
    (vocab.LOGIT_STD, "final_logit_std", True),
    ("peaked", "final_peaked", True),
    ("peaked (entropy)", f"final_{PEAKED_ENTROPY}", True),
    ("β_eff", "final_beta_eff", True),
    (vocab.FIRST_KEY_PROB, "final_first_key_prob", True),
    ("max logit", f"final_{vocab.LOGIT_MAX}", True),
    ("sensitivity", "sensitivity", True),
    ("role", "role", False),
    ("role since step", "role_step", True),
)
OPTIONAL_COLUMNS = ("sensitivity", f"final_{PEAKED_ENTROPY}", "final_beta_eff", "share", "gain_alpha",
                    f"final_{vocab.LOGIT_MAX}")
TEXT_COLUMNS = ("site_class", "verdict", "role")
ROLE_COLUMNS = ("role", "role_step")  # shown when any head's role was measured


def _cell(text: str, v: float | None = None, text_col: bool = False) -> dict:
    return {"text": text, "v": v, "text_col": text_col}


def _heads_view(heads: pd.DataFrame) -> tuple[list[tuple[str, bool]], list[list[dict]]]:
    cols = [
        c
        for c in HEAD_COLUMNS
        if (c[1] not in OPTIONAL_COLUMNS or bool(np.isfinite(heads[c[1]]).any()))
        and (c[1] != "verdict" or bool((heads["verdict"] != "").any()))
        and (c[1] not in ROLE_COLUMNS or bool((heads["role"] != "").any()))
    ]
    rows = []
    for r in heads.to_dict("records"):
        lm = r["site_kind"] == LM_HEAD
        router = r["site_kind"] == vocab.ROUTER
        cells = []
        for _, col, _ in cols:
            v = r[col]
            if col == "layer":
                cells.append(_cell("LM" if lm else f"router {int(v)}" if router else str(int(v))))
            elif col == "head":
                cells.append(_cell("—" if lm or router else str(int(v))))
            elif col == "role_step":
                cells.append(_cell(str(int(v)) if v >= 0 else "—", float(v) if v >= 0 else None))
            elif col in TEXT_COLUMNS:
                cells.append(_cell(str(v) or "—", text_col=True))
            elif col == "share":
                cells.append(_cell(pct(v), repr(float(v)) if math.isfinite(v) else None))
            elif col == "alpha":
                finite = math.isfinite(v)
                text = f"{num(v, '.3g')} [{num(r['alpha_lo'], '.3g')}, {num(r['alpha_hi'], '.3g')}]"
                cells.append(_cell(text, repr(float(v)) if finite else None))
            else:
                cells.append(_cell(num(v, ".4g")))
        rows.append(cells)
    return [(name, numeric) for name, _, numeric in cols], rows


def _provenance(
    run: RunData, command: str | None, generated_at: str, software: dict
) -> list[tuple[str, str]]:
    m = run.manifest
    data = m.get("data") or {}
    n_done = run.results["revision"].nunique()
    return [
        ("model", str(m.get("model"))),
        ("source", str(m.get("source"))),
        ("run directory", str(run.run_dir)),
        (
            "checkpoints",
            f"{n_done} finished of {len(m.get('checkpoints') or [])} planned, "
            f"{len(run.failures)} failed; time axis {run.time_axis}",
        ),
        (
            "data",
            f"{data.get('spec')} — {data.get('n_windows')} windows × {data.get('window')} tokens",
        ),
        ("data hash", str(data.get("token_hash"))),
        ("probe", ", ".join(f"{k}={v}" for k, v in sorted((m.get("probe") or {}).items()))),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items()))),
        ("report software", ", ".join(f"{k} {v}" for k, v in sorted(software.items()))),
        ("command", command if command else "not recorded"),
        ("generated", generated_at),
    ]


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
    ranking = sensitivity_ranking(heads)
    ranked = [
        {
            "label": site_label(r["site_kind"], r["layer"], r["head"]),
            "sensitivity": r["sensitivity"],
            "alpha": r["alpha"],
            "site_class": r["site_class"],
        }
        for r in ranking.head(MAX_RANKED_ROWS).to_dict("records")
    ]
    res = run.results.drop_duplicates("revision")
    revs = [f"{rev} (step {step})" for rev, step in zip(res["revision"], res["step"], strict=True)]
    shown = ", ".join(revs[:MAX_LISTED_REVISIONS]) + (" …" if len(revs) > MAX_LISTED_REVISIONS else "")
    head_columns, head_rows = _heads_view(heads)
    loss = summary["loss"]
    return ENV.get_template(TEMPLATE).render(
        s=summary,
        css=_raw("report.css"),
        script=_raw("sort.js"),
        figures={name: _figure_view(fig) for name, fig in figures.items()},
        flags=list(summary["flags"]) + (list(loss["flags"]) if loss else []),
        ranked=ranked,
        n_ranked=len(ranking),
        head_columns=head_columns,
        head_rows=head_rows,
        show_peaked_entropy=any(name == "peaked (entropy)" for name, _ in head_columns),
        provenance=_provenance(run, command, generated_at, software),
        n_revisions=len(revs),
        revisions=shown,
        failures=[
            {"revision": str(f.get("revision", "?")), "error": str(f.get("error", ""))}
            for f in run.failures
        ],
        integrity_file=INTEGRITY,
        heads_line=heads_line(summary["bottleneck"]),
    )
