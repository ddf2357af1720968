"""``summary.md``: the summary.json object written as Markdown, for a terminal or a README.

Owns: the Markdown rendering of every summary block (verdicts, exponents with band and window,
gains, window scan, peakedness, integrity, top sites, sensitivity, provenance) and the few
sentences the HTML page shares with it (head counts, a duplicated checkpoint). User text is
written as code spans or escaped for table cells; nothing here reads files or the clock.
"""

from __future__ import annotations

from typing import Any

from peakprobe.formatting import num, pct
from peakprobe.vocab import QK_SPECTRAL, site_label


def _md(text: Any) -> str:
    """User text made safe inside a Markdown table cell or line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: Any) -> str:
    """User text (names, revisions, hashes) as a Markdown code span, so it renders literally."""
    body = str(text).replace("\n", " ")
    fence = "`"
    while fence in body:
        fence += "`"
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def _ci(e: dict) -> str:
    return f"{num(e['alpha'])} [{num(e['alpha_lo'])}, {num(e['alpha_hi'])}]"


def _window(e: dict) -> str:
    pts = f", {e['n_points']} pts" if e.get("n_points") is not None else ""
    return f"{num(e['t_min'])}–{num(e['t_max'])}{pts}"


def _label(t: dict) -> str:
    return site_label(
        t["site_kind"],
        t["layer"] if t["layer"] is not None else -1,
        t["head"] if t["head"] is not None else -1,
    )


def dup_text(d: dict, code: Any = str) -> str:
    """One duplicated checkpoint in words (``code`` formats revision names)."""
    text = code(d["revision"])
    if d["same_as"]:
        text += " has the same weights as " + ", ".join(code(x) for x in d["same_as"])
    if d["whole"] is False:
        text += f" (partly: {', '.join(d['files'])})"
    if d["excluded"]:
        text += " — excluded from the fits"
    else:
        text += " — NOT excluded by this fit (re-run `peakprobe fit`)"
    return text


def _share(e: dict) -> str:
    return f"{pct(e['share'])} [{pct(e['share_lo'])}, {pct(e['share_hi'])}]"


def _interval(e: dict, key: str) -> str:
    return f"{num(e[key])} [{num(e[key + '_lo'])}, {num(e[key + '_hi'])}]"


def _yes(x: Any) -> str:
    return {True: "yes", False: "no"}.get(x, "—")


def heads_line(b: dict) -> str:
    """The head counts of the bottleneck block, in words (parts fit did not write are left out)."""
    parts = []
    if b["n_heads"] is not None:
        parts.append(f"{num(b['n_peaked'])} of {num(b['n_heads'])} attention heads peaked")
    parts.append(
        f"{num(b['n_concentrating'])} concentrating, {num(b['n_saturated'])} saturated, "
        f"{num(b['n_diffuse'])} diffuse"
    )
    if b["n_share_significant"] is not None and any(k["share"] is not None for k in b["kinds"]):
        parts.append(
            f"{num(b['n_share_significant'])} sites with a gain share significantly above "
            f"{pct(b['share_min'])} (Benjamini-Hochberg, FDR {num(b['fdr'])})"
        )
    return "; ".join(parts) + "."


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines (header, rule, rows) and the blank line after it."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def factor_lines(f: dict) -> list[str]:
    """The section on why the logits grow (nothing when the run has no geometry fits)."""
    if not f.get("measured"):
        return []
    lines = ["## Why the logits grow", "",
             "The RMS logit over visible pairs is exactly scaling × q_rms × k_rms × qk_align, so "
             "the growth exponents of the query norm, key norm and alignment add up to the RMS "
             "logit's (least squares on log-log axes over the RMS logit's fit window, so they add up "
             "exactly). For "
             + ("all heads (no head is peaked)" if f["heads_of"] == "all heads" else "the peaked heads")
             + ", the factor that carries the growth is the one with the largest exponent. The last "
             "column is the exponent of the head's ‖W_Qᵀ W_K‖₂ (qk_spectral_norm) over the same "
             "window: growth in the weights themselves, not a factor.", ""]
    return lines + _table(
        ["head", "logit_rms α", "q_rms α", "k_rms α", "qk_align α", "sum", "carried by", "‖W_Qᵀ W_K‖ α"],
        [[r["label"], num(r["alpha_logit_rms"]), num(r["alpha_q_rms"]), num(r["alpha_k_rms"]),
          num(r["alpha_qk_align"]), num(r["alpha_sum"]), r["carrier"] or "—",
          num(r.get(f"alpha_{QK_SPECTRAL}", float("nan")))] for r in f["rows"]])


def role_lines(roles: dict) -> list[str]:
    """The head roles' section (nothing when the run has no role scores)."""
    if not roles.get("measured"):
        return []
    lines = ["## Head roles", "",
             f"On the diagnostic batch of repeated random tokens: a head's role is the one whose "
             f"score (induction, previous-token, duplicate-token; sink: first_key_prob) is "
             f"largest at the last checkpoint, when at least {roles['threshold']:g}; it emerged at "
             "the first checkpoint from which that score stays at or above the threshold.", ""]
    if not roles["heads"]:
        return lines + ["No head holds a role.", ""]
    return lines + _table(["head", "role", "score", "since step"],
                          [[h["label"], h["role"], num(h["score"]), str(h["since_step"])]
                           for h in roles["heads"]])


def roles_text(roles: dict, most: int = 4) -> str | None:
    """The terminal line of the head roles: per role its heads (at most ``most`` listed, by
    score) with score and emergence step; None when the run has no role scores."""
    if not roles.get("measured"):
        return None
    head = f"head roles (diagnostic batch, score >= {roles['threshold']:g} at the last checkpoint):"
    by_role: dict[str, list[dict]] = {}
    for h in sorted(roles["heads"], key=lambda h: -h["score"]):
        by_role.setdefault(h["role"], []).append(h)
    if not by_role:
        return f"{head} none"
    parts = []
    for role, heads in by_role.items():
        listed = ", ".join(f"{h['label']} {h['score']:.2f}, since step {h['since_step']}"
                           for h in heads[:most])
        more = f", {len(heads) - most} more" if len(heads) > most else ""
        parts.append(f"{role} {len(heads)} ({listed}{more})")
    return f"{head} " + "; ".join(parts)


def router_lines(routers: list[dict]) -> list[str]:
    """The MoE routers' section (nothing for a dense model)."""
    if not routers:
        return []
    lines = ["## MoE routers", "",
             "Per router: logit_std growth α [CI] and verdict, class, share of the loss decrease [CI] when "
             "measured, and at the last checkpoint the token-mean entropy, max prob and top-k "
             "mass over experts, the entropy of the expert load (nats), the dead-expert fraction "
             "and the largest load over the mean.", ""]
    lines += _table(
        ["router", "growth α [CI]", "verdict", "class", "share [CI]", "entropy", "max prob",
         "top-k mass", "load entropy", "dead", "max/mean load"],
        [[r["label"], _interval(r, "alpha"), r["verdict"] or "—", r["site_class"] or "—",
          _share(r), num(r["final_entropy"]), num(r["final_max_prob"]), num(r["final_topk_mass"]),
          num(r["final_load_entropy"]), num(r["final_dead_experts"]),
          num(r["final_load_max_over_mean"])] for r in routers])
    return lines


def _headline(s: dict, band: str) -> list[str]:
    """The title and the verdicts: loss law, bottleneck with its exponents, heads, flags."""
    lines = [f"# peakprobe report: {_code(s['model'])}", ""]
    p = s["peakedness"]
    if p["any_peaked"] is False:
        lines += [f"> **No softmax is peaked.** {p['statement']}", ""]
    loss = s["loss"]
    for k in s.get("skipped", []):
        lines.append(f"- **Skipped:** the {_md(k['fit'])} fit: {_md(k['reason'])}.")
    if loss is None:
        lines.append("- **Loss law:** no loss fit in this run.")
    else:
        lines.append(
            f"- **Loss law:** L = L0 + c·t^-α with α = {_ci(loss)} "
            f"({s['ci_level']:.0%} CI), L0 = {num(loss['L0'])}, window {s['time_axis']} "
            f"{_window(loss)}; **{loss['verdict']}** against 1/3 (band {band}): "
            f"{loss['verdict_text']}."
        )
    b = s["bottleneck"]
    line = f"- **Bottleneck:** {_md(b['verdict'] or 'undetermined')}"
    if b["share"] is not None:
        line += f" (its gain is {_share(b)} of the loss decrease)"
    if b["reason"]:
        line += f" — {_md(b['reason'])}"
    lines.append(line)
    for e in b["exponents"]:
        lines.append(f"  - {e['label']} {e['quantity']}: α = {_ci(e)}, {e['verdict']}")
    lines.append(f"- **Heads:** {heads_line(b)}")
    if s["flags"]:
        lines.append(f"- **Flags:** {_md(', '.join(s['flags']))}")
    lines.append("")
    return lines


def _fits_sections(s: dict, band: str) -> list[str]:
    """Exponents against 1/3, the loss contribution per softmax, the window scan."""
    lines = []
    if s["exponents"]:
        lines += [
            "## Exponents against 1/3",
            "",
            f"Band {band}; window in {s['time_axis']}.",
            "",
        ]
        lines += _table(["site", "quantity", "α [CI]", "verdict", "window"],
                        [[e["label"], e["quantity"], _ci(e), e["verdict"], _window(e)]
                         for e in s["exponents"]])
    lines += ["## Loss contribution G per softmax", ""]
    if not s["gains"]["measured"]:
        lines += ["Not measured in this run (the sweep ran without gains).", ""]
    else:
        lines += _table(
            ["site", "final G", "share of the loss decrease [CI]", "decay α [CI]", "verdict", "window"],
            [[g["label"], num(g["final_gain"]), _share(g), _ci(g), g["verdict"] or "—",
              _window(g) if g["t_min"] is not None else "—"] for g in s["gains"]["sites"]])
    lines += ["## Window scan α(t_min)", ""]
    if not s["window_scan"]["measured"]:
        lines += ["Not measured (fits.json has no window scan).", ""]
    else:
        if s["window_scan"]["drift"]:
            lines += ["**The exponent drifts with the window start** (two starts give disjoint intervals).", ""]
        lines += _table(["quantity", "t_min", "t_max", "α [CI]", "verdict"],
                        [[_md(r["quantity"]), num(r["t_min"]), num(r["t_max"]), _ci(r), r["verdict"]]
                         for r in s["window_scan"]["rows"]])
    return lines


def _peakedness_and_integrity(s: dict) -> list[str]:
    """Peakedness by each criterion; duplicated and spike-flagged checkpoints."""
    p = s["peakedness"]
    lines = ["## Peakedness", "", _md(p["statement"]), ""]
    if p["criteria"]:
        lines += _table(["criterion", "attention heads peaked", "LM head"],
                        [[c["label"], f"{c['n_attn_peaked']} of {c['n_attn']}" if c["measured"]
                          else "not measured", num(c["lm_head"])] for c in p["criteria"]])
    ck = s["checkpoints"]
    lines += ["## Checkpoint integrity", ""]
    if ck["duplicates"]:
        lines.append(f"Duplicated checkpoints ({len(ck['duplicates'])}):")
        for d in ck["duplicates"]:
            lines.append(f"- {dup_text(d, _code)}")
    else:
        lines.append(
            "No duplicated checkpoint found."
            if ck["integrity_checked"]
            else "Duplicated checkpoints: not checked (no integrity.json)."
        )
    if ck["spikes"]:
        lines.append(f"Loss spikes flagged by the fit, still fitted ({len(ck['spikes'])}):")
        for d in ck["spikes"]:
            lines.append(f"- {_code(d['revision'])}: loss {num(d['loss'])}, jump {num(d['jump'])}")
    else:
        lines.append("No spike-flagged checkpoint.")
    lines.append("")
    return lines


def _sites_sections(s: dict) -> list[str]:
    """The evidence per kind, the top sites and the sensitivity ranking."""
    b, lines = s["bottleneck"], []
    if b["kinds"]:
        lines += [
            "## Evidence per kind",
            "",
        ]
        lines += _table(
            ["kind", "peaked", "share of the loss decrease [CI]", "q", "gain decay α [CI]", "verdict",
             "logit_std growth α [CI]", "verdict"],
            [[k["label"], _yes(k["peaked"]), _share(k), num(k["q_share"]), _interval(k, "alpha_gain"),
              k["gain_verdict"] or "—", _interval(k, "alpha_growth"), k["growth_verdict"] or "—"]
             for k in b["kinds"]])
    if b["top_sites"]:
        lines += [
            "## Top sites",
            "",
        ]
        lines += _table(
            ["site", "peaked", "share [CI]", "gain α", "verdict", "class", "sensitivity"],
            [[_label(t), _yes(t["peaked"]), _share(t), num(t["alpha_gain"]), t["gain_verdict"] or "—",
              t["site_class"] or "—", num(t["sensitivity"])] for t in b["top_sites"]])
    sens = s["sensitivity"]
    lines.append("## Sensitivity ranking")
    lines.append("")
    if not sens["measured"]:
        lines += ["Not measured in this run (the sweep ran without sensitivity).", ""]
    else:
        lines += [
            "Most negative d loss / d log β first.",
            "",
        ]
        lines += _table(["site", "d loss / d log β", "α", "class"],
                        [[_label(t), num(t["sensitivity"]), num(t["alpha"]), t["site_class"] or "—"]
                         for t in sens["top"]])
    return lines


def _provenance(s: dict) -> list[str]:
    c, d = s["checkpoints"], s["data"]
    return [
        "## Provenance",
        "",
        f"- model: {_code(s['model'])} (source: {_code(s['source'])})",
        f"- checkpoints: {c['n']} finished of {c['n_planned']} planned ({c['n_failed']} failed), "
        f"{_code(c['first_revision'])} … {_code(c['last_revision'])}; time axis {s['time_axis']}",
        f"- data: {_code(d['spec'])}, {num(d['n_windows'])} windows × {num(d['window'])} tokens, {_code(d['token_hash'])}",
        "- versions: "
        + ", ".join(f"{_md(k)} {_code(v)}" for k, v in sorted(s["versions"].items())),
        "",
    ]


def digest_markdown(s: dict) -> str:
    """summary.md: the verdicts, the key numbers and the provenance, for a terminal or a README."""
    band = f"[{num(s['band'][0])}, {num(s['band'][1])}]"
    return "\n".join(_headline(s, band) + _fits_sections(s, band) + _peakedness_and_integrity(s)
                     + _sites_sections(s) + router_lines(s.get("routers") or [])
                     + role_lines(s.get("roles") or {}) + factor_lines(s.get("logit_factors") or {})
                     + _provenance(s))
