"""Peakedness of sites, site classes, and the bottleneck verdict from the gains.

Peaked (at the fitted window's last checkpoint): a site is peaked when, by either criterion,
at least PEAKED_FRACTION of its rows are: ``peaked`` (logit std > sqrt(2 ln n)) or
``peaked_entropy`` (the entropy-equivalent inverse temperature beta_eff > sqrt(2 ln n)). For
attention heads the ``_xsink`` statistics (the sink key left out) replace the raw flags when the
results carry them, so a head parked on the sink does not count as peaked. An `attn_layer`
group or `attn_all` is peaked when one of its heads is.

Site class (heads and the LM head), from the late logit_std fit (the power law refitted on the
second half of the window in log time) and a multiple-comparison control over sites:

* ``concentrating``: peaked and still growing: the one-sided bootstrap p-value of "late alpha
  <= GROWTH_FLOOR" is a discovery after Benjamini-Hochberg at level FDR over all sites;
* ``saturated``: peaked, not (significantly) growing;
* ``diffuse``: not peaked;
* empty: not classifiable (no peakedness metric or no logit_std fit).

Bottleneck verdict (`decide`), in this order:

1. no peakedness metric at all: ``undetermined``;
2. no site peaked: ``none`` — "no softmax is peaked: the 1/3 mechanism does not apply" — when
   both criteria were measured; by the logit-std flag alone (older runs without
   ``peaked_entropy``) ``undetermined``, since that flag misses near-deterministic softmaxes;
3. no `gain` metric in the results: ``undetermined`` (the verdict is never guessed from the
   sign of a sensitivity); no loss-law fit (no L - L0): ``undetermined``;
4. the candidate kinds are the peaked kinds with a significant gain share: some peaked site
   of the kind has G / (L - L0) > GAIN_SHARE_MIN at the window's end, a BH discovery at level
   FDR within its family (heads; layer groups; whole kinds); none: ``undetermined``;
5. among the candidates, the kind whose gain decays slowest (smallest alpha_gain; ties by the
   larger share) is the verdict: ``attention`` or ``lm_head``.

Counts of heads are only ever reported after the BH control; the sensitivity
(d loss / d log beta) is carried along as description and decides nothing.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pandas as pd

from peakprobe import vocab
from peakprobe.formatting import num, pct

N_TOP_SITES = 10
KIND_NAMES = {vocab.BOTTLENECK_ATTENTION: "attention", vocab.BOTTLENECK_LM_HEAD: "the LM head"}
#: the terminal's numbers: three decimals, n/a when missing
_n = partial(num, fmt=".3f", missing="n/a")
_pct = partial(pct, fmt=".0f", missing="n/a")
NOT_PEAKED = "no softmax is peaked: the 1/3 mechanism does not apply"


def peaked_criteria(site_kind: str, available: set[str]) -> list[str]:
    """The peakedness flags used for a site kind, given the metric names the results hold."""
    out = []
    for base in (vocab.PEAKED, vocab.PEAKED_ENTROPY):
        names = [base + vocab.XSINK_SUFFIX, base] if site_kind == vocab.ATTN else [base]
        for name in names:
            if name in available:
                out.append(name)
                break
    return out


def is_peaked(values: dict[str, float], criteria: list[str]) -> bool | None:
    """Peaked by any criterion (row fraction >= PEAKED_FRACTION); None when none is measured."""
    seen = [values.get(c, math.nan) for c in criteria]
    seen = [v for v in seen if math.isfinite(v)]
    if not seen:
        return None
    return any(v >= vocab.PEAKED_FRACTION for v in seen)


def classify(peaked: bool | None, q_growing: float, fdr: float = vocab.FDR) -> str:
    """The class of one site (see the module docstring); empty when not classifiable."""
    if peaked is None:
        return ""
    if not peaked:
        return "diffuse"
    return "concentrating" if (math.isfinite(q_growing) and q_growing <= fdr) else "saturated"


def describe_kind(name: str, k: dict) -> str:
    """One sentence about a kind's gain share and exponents."""
    return (
        f"{KIND_NAMES.get(name, name)} carries {_pct(k['share'])} "
        f"[{_pct(k['share_lo'])}, {_pct(k['share_hi'])}] of L - L0 at the end of the window "
        f"(gain of {k['site']}); "
        f"its gain decays as t^-{_n(k['alpha_gain'])} [{_n(k['alpha_gain_lo'])}, "
        f"{_n(k['alpha_gain_hi'])}] -> {k['gain_verdict']}; its logit_std grows as "
        f"t^{_n(k['alpha_growth'])} [{_n(k['alpha_growth_lo'])}, "
        f"{_n(k['alpha_growth_hi'])}] -> {k['growth_verdict']}"
    )


def decide(kinds: dict[str, dict], *, has_peaked_metric: bool, has_gain: bool, has_loss: bool,
           has_entropy_criterion: bool = True, fdr: float = vocab.FDR,
           share_min: float = vocab.GAIN_SHARE_MIN) -> tuple[str, str]:
    """(verdict, reason) from the per-kind blocks of fits.json (module docstring)."""
    peaked = [name for name, k in kinds.items() if k["peaked"]]
    counts = "; ".join(f"{KIND_NAMES.get(n, n)}: {k['n_peaked']} of {k['n_sites']} sites peaked"
                       for n, k in kinds.items())
    if not has_peaked_metric:
        return vocab.BOTTLENECK_UNDETERMINED, (
            "the results carry no peakedness metric (peaked / peaked_entropy), so whether the "
            "1/3 mechanism applies cannot be judged")
    if not peaked and not has_entropy_criterion:
        return vocab.BOTTLENECK_UNDETERMINED, (
            "no softmax is peaked by its logit std, but the results carry no peaked_entropy "
            "(the entropy-equivalent beta_eff criterion, which catches near-deterministic "
            f"softmaxes whose logit std stays low): re-sweep to decide ({counts})")
    if not peaked:
        return vocab.BOTTLENECK_NONE, f"{NOT_PEAKED} ({counts})"
    if not has_gain:
        return vocab.BOTTLENECK_UNDETERMINED, (
            "the bottleneck cannot be computed without gains: the results carry no `gain` "
            "metric (an older run, or attribution off); sensitivity signs are not used to "
            f"guess ({counts})")
    if not has_loss:
        return vocab.BOTTLENECK_UNDETERMINED, (
            "no loss-law fit, so no L - L0 to share the gains of")
    cands = [n for n in peaked if kinds[n].get("significant")]
    if not cands:
        return vocab.BOTTLENECK_UNDETERMINED, (
            f"no peaked softmax carries a significant share of L - L0 (> {share_min:g}, "
            f"Benjamini-Hochberg at {fdr:g} over the gain sites) ({counts})")

    def key(n: str) -> tuple[float, float]:
        a = kinds[n].get("alpha_gain")
        s = kinds[n].get("share")
        return (a if a is not None and math.isfinite(a) else math.inf,
                -(s if s is not None and math.isfinite(s) else -math.inf))

    best = min(cands, key=key)
    reason = describe_kind(best, kinds[best])
    others = [n for n in cands if n != best]
    if others:
        reason += f"; it decays slower than {KIND_NAMES.get(others[0], others[0])}"
    return best, reason + f" ({counts})"


def top_sites(sites: pd.DataFrame, n: int = N_TOP_SITES) -> list[dict]:
    """Heads and the LM head: significant gain shares first, then sites whose share interval
    is informative (its upper end within ``vocab.SHARE_CI_INFORMATIVE`` of L - L0), then by
    share, then by late alpha. A point share from a fit whose interval spans everything (e.g.
    a power law through a few points, extrapolated) is no reason to rank a site high."""
    heads = sites[sites["site_kind"].isin([vocab.ATTN, vocab.LM_HEAD])]
    order = heads.assign(
        _sig=~(heads["q_share"].fillna(1.0) <= vocab.FDR),
        _open=~(heads["share_hi"].fillna(np.inf) <= vocab.SHARE_CI_INFORMATIVE),
        _share=-heads["share"].fillna(-1.0),
        _alpha=-heads["alpha_late"].fillna(-np.inf),
    ).sort_values(["_sig", "_open", "_share", "_alpha", "site_kind", "layer", "head"], kind="stable")
    keys = ("share", "share_lo", "share_hi", "q_share", "alpha_gain", "alpha_late",
            "sensitivity")
    return [
        {"site_kind": str(r["site_kind"]), "layer": int(r["layer"]), "head": int(r["head"]),
         "label": str(r["label"]), "peaked": None if pd.isna(r["peaked"]) else bool(r["peaked"]),
         "site_class": str(r["site_class"]), "gain_verdict": str(r["gain_verdict"]),
         **{k: float(r[k]) for k in keys}}
        for _, r in order.head(n).iterrows()
    ]
