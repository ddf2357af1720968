"""Peakedness of sites, site classes, and the bottleneck verdict from the gains.

Peaked (at the fitted window's last checkpoint): a site is peaked when at least
PEAKED_FRACTION of its rows are ``peaked_entropy``: the entropy-equivalent inverse temperature
beta_eff > sqrt(2 ln n), whose meaning is "the distribution is concentrated". The logit-std flag
``peaked`` is used only for results that lack ``peaked_entropy``: a softmax that has learned to
rule tokens out (logits far below the rest) has a large logit std at an entropy near uniform
over the tokens it still considers, and is not peaked. For attention heads the ``_xsink``
statistics (the sink key left out) replace the raw flags when the results carry them, so a head
parked on the sink does not count as peaked. An `attn_layer` group or `attn_all` is peaked when
one of its heads is.

Gain shares (`drop_share`, `floor_share`): a gain site's ``share`` is the share of the loss
*decrease* over the window that the gain's decrease explains, (G(t1) - G(t2)) / (L(t1) - L(t2))
at the window's ends, read off the gain's and the loss's fitted laws. The loss law's floor L0
cancels in L(t1) - L(t2), which the fit must match to the data, so the share does not hinge on
L0 (a free-floor law that buys late curvature with a low L0 inflates L - L0 several-fold). Its
interval pairs the gain's and the loss's bootstrap refits by index; its p-value is the
one-sided normal tail of "share <= GAIN_SHARE_MIN" with the bootstrap's robust scale
(interquartile range / 1.349), and
Benjamini-Hochberg runs within three families (heads; layer groups; attn_all and the LM head).
``share_floor`` = G(t_end) / (L - L0)(t_end), both read off their fitted laws, with a paired
bootstrap interval, is reported beside it and decides nothing.

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
   of the kind explains more than GAIN_SHARE_MIN of the loss decrease over the window, a BH
   discovery at level FDR within its family (heads; layer groups; whole kinds); none:
   ``undetermined``, and when attention is peaked and its gain small the reason says that the
   gain sees only a temperature-limited softmax (the 1/3 mechanism) and not a head limited by
   which keys it ranks first;
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

from .common import bh_qvalues, p_at_most, percentile_interval
from .third import judge_third

N_TOP_SITES = 10
#: the families of gain-share tests, each under its own Benjamini-Hochberg control
SHARE_FAMILIES = ((vocab.ATTN,), (vocab.ATTN_LAYER,), (vocab.ATTN_ALL, vocab.LM_HEAD), (vocab.ROUTER,))
#: a gain site's share columns: the verdict's (of the loss decrease) and the one of L - L0
SHARE_KEYS = ("share", "share_lo", "share_hi", "p_share", "share_floor", "share_floor_lo",
              "share_floor_hi")
SHARE_OF = "the loss decrease over the window"
RANKING_LIMIT = ("the gain sees only a softmax whose ranking is right and whose temperature is "
                 "too low (the 1/3 mechanism's claim); a head limited by which keys it ranks "
                 "first is outside what it measures")
KIND_NAMES = {vocab.BOTTLENECK_ATTENTION: "attention", vocab.BOTTLENECK_LM_HEAD: "the LM head"}
#: the terminal's numbers: three decimals, n/a when missing
_n = partial(num, fmt=".3f", missing="n/a")
_pct = partial(pct, fmt=".0f", missing="n/a")
NOT_PEAKED = "no softmax is peaked: the 1/3 mechanism does not apply"


def peaked_criteria(site_kind: str, available: set[str]) -> list[str]:
    """The peakedness flag used for a site kind, given the metric names the results hold:
    beta_eff's ``peaked_entropy`` where measured, else the logit-std ``peaked``."""
    for base in (vocab.PEAKED_ENTROPY, vocab.PEAKED):
        names = [base + vocab.XSINK_SUFFIX, base] if site_kind == vocab.ATTN else [base]
        for name in names:
            if name in available:
                return [name]
    return []


def drop_share(fit: dict, boot, loss_fit, loss_boot, t1: float, t2: float) -> dict[str, float]:
    """The gain's share of the loss decrease over the window [t1, t2]: (G(t1) - G(t2)) /
    (L(t1) - L(t2)), both read off their fitted laws (L's floor cancels), with the paired
    bootstrap interval and the p-value of "share <= GAIN_SHARE_MIN" (``boot``: the gain fit's
    (icept, slope, xbar); ``fit``'s alpha is the decay exponent)."""
    out = {"share": math.nan, "share_lo": math.nan, "share_hi": math.nan, "p_share": math.nan}
    if "alpha" not in fit or loss_fit is None or not t2 > t1:
        return out
    drop_l = loss_fit.c * (t1 ** -loss_fit.alpha - t2 ** -loss_fit.alpha)
    if not drop_l > 0:  # the fitted loss does not fall over the window: no share of a decrease
        return out
    out["share"] = fit["c"] * (t1 ** -fit["alpha"] - t2 ** -fit["alpha"]) / drop_l
    if boot is not None and loss_boot is not None:
        def g(t: float) -> np.ndarray:  # (B,) the refitted gain at t
            return np.exp(boot[0] + boot[1] * (math.log(t) - boot[2]))
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = (g(t1) - g(t2)) / (loss_boot.reducible_at(t1) - loss_boot.reducible_at(t2))
        shares = shares[np.isfinite(shares)]
        if shares.size >= 2:
            lo, hi = percentile_interval(shares, vocab.CI_LEVEL)
            out["share_lo"], out["share_hi"] = float(lo), float(hi)
            # robust scale: a ratio of two bootstrap drops has a few huge draws
            out["p_share"] = float(p_at_most(np.array([out["share"]]), shares[None, :],
                                             vocab.GAIN_SHARE_MIN, robust=True)[0])
    return out


def floor_share(fit: dict, boot, loss_fit, loss_boot, t_end: float) -> dict[str, float]:
    """G(t_end) / (L - L0)(t_end) from the gain's fit ``fit`` (alpha: decay exponent) and the
    loss law, with the paired bootstrap interval (``boot``: the gain fit's (icept, slope, xbar))."""
    out = {"share_floor": math.nan, "share_floor_lo": math.nan, "share_floor_hi": math.nan}
    if "alpha" not in fit or loss_fit is None:
        return out
    r_end = loss_fit.c * t_end ** -loss_fit.alpha
    out["share_floor"] = fit["c"] * t_end ** -fit["alpha"] / r_end
    if boot is not None and loss_boot is not None:
        g_end = np.exp(boot[0] + boot[1] * (math.log(t_end) - boot[2]))  # (B,)
        lo, hi = percentile_interval(g_end / loss_boot.reducible_at(t_end), vocab.CI_LEVEL)
        out["share_floor_lo"], out["share_floor_hi"] = float(lo), float(hi)
    return out


def share_qvalues(sites: pd.DataFrame) -> np.ndarray:
    """BH q-values of the sites' share p-values within each of SHARE_FAMILIES."""
    q = np.full(len(sites), np.nan)
    for family in SHARE_FAMILIES:
        rows = np.flatnonzero(sites["site_kind"].isin(family).to_numpy())
        q[rows] = bh_qvalues(sites["p_share"].to_numpy(dtype=float)[rows])
    return q


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
        f"{KIND_NAMES.get(name, name)}'s gain explains {_pct(k['share'])} "
        f"[{_pct(k['share_lo'])}, {_pct(k['share_hi'])}] of {SHARE_OF} "
        f"(gain of {k['site']}; {_pct(k.get('share_floor'))} of L - L0 at the window's end); "
        f"its gain decays as t^-{_n(k['alpha_gain'])} [{_n(k['alpha_gain_lo'])}, "
        f"{_n(k['alpha_gain_hi'])}] -> {k['gain_verdict']}; its logit_std grows as "
        f"t^{_n(k['alpha_growth'])} [{_n(k['alpha_growth_lo'])}, "
        f"{_n(k['alpha_growth_hi'])}] -> {k['growth_verdict']}"
    )


def decide(kinds: dict[str, dict], *, has_peaked_metric: bool, has_gain: bool, has_loss: bool,
           has_entropy_criterion: bool = True, fdr: float = vocab.FDR,
           share_min: float = vocab.GAIN_SHARE_MIN, floor_doubtful: bool = False) -> tuple[str, str]:
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
        limit = f"; {RANKING_LIMIT}" if vocab.BOTTLENECK_ATTENTION in peaked else ""
        return vocab.BOTTLENECK_UNDETERMINED, (
            f"no peaked softmax's gain explains a significant share of {SHARE_OF} "
            f"(> {share_min:g}, Benjamini-Hochberg at {fdr:g} over the gain sites){limit} "
            f"({counts})")

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
    if floor_doubtful:
        reason += ("; the loss law's floor L0 is unreliable (drift or a bound), so the share "
                   "of L - L0 is not used")
    return best, reason + f" ({counts})"


def kind_blocks(sites: pd.DataFrame, growth_of: dict, attn_growth: dict | None,
           band: tuple[float, float]) -> dict[str, dict]:
    """fits.json's bottleneck.kinds: per softmax kind, peakedness, share and exponents."""
    out = {}
    heads = sites[sites["site_kind"] == vocab.ATTN]
    groups = sites[sites["site_kind"].isin([vocab.ATTN, vocab.ATTN_LAYER, vocab.ATTN_ALL])]
    lm = sites[sites["site_kind"] == vocab.LM_HEAD]
    if len(heads) or len(groups):
        sig = groups[(groups["q_share"] <= vocab.FDR) & groups["peaked"].fillna(False).astype(bool)]
        rep = groups[groups["site_kind"] == vocab.ATTN_ALL]
        rep = rep[np.isfinite(rep["share"].to_numpy(dtype=float))]
        if rep.empty:
            pool = sig[sig["site_kind"] == vocab.ATTN]
            pool = pool if len(pool) else heads[np.isfinite(heads["share"].to_numpy(dtype=float))]
            rep = pool.sort_values("share", ascending=False, kind="stable")
        g = attn_growth or {}
        out[vocab.BOTTLENECK_ATTENTION] = _kind_block(
            heads, rep.iloc[0] if len(rep) else None, bool(len(sig)), g, band,
            f"mean logit_std over {g.get('n_heads', 0)} {g.get('of', 'heads')}")
    if len(lm):
        row = lm.iloc[0]
        g = growth_of.get((vocab.LM_HEAD, -1, -1), {})
        sig = bool(row["q_share"] <= vocab.FDR and row["peaked"])
        out[vocab.BOTTLENECK_LM_HEAD] = _kind_block(lm, row if math.isfinite(row["share"]) else None,
                                                    sig, g, band, "LM head logit_std")
    return out


def _gain_site(rep: pd.Series | None) -> str | None:
    """The site whose gain a kind's share reads, as the verdict names it."""
    if rep is None:
        return None
    after = rep.get("gain_metric", "") == vocab.GAIN_AFTER_ATTENTION
    return f"{rep['label']} after attention" if after else str(rep["label"])


def _kind_block(members: pd.DataFrame, rep: pd.Series | None, significant: bool, growth: dict,
                band: tuple[float, float], growth_of: str) -> dict:
    peaked = members["peaked"].fillna(False).astype(bool)
    def f(v) -> float | None:
        return float(v) if v is not None and math.isfinite(float(v)) else None
    get = (lambda k: f(rep[k])) if rep is not None else (lambda k: None)
    a_lo, a_hi = f(growth.get("alpha_lo", math.nan)), f(growth.get("alpha_hi", math.nan))
    return {
        "peaked": bool(peaked.any()), "n_sites": int(len(members)), "n_peaked": int(peaked.sum()),
        "site": _gain_site(rep), "significant": significant,
        **{k: get(k) for k in (*SHARE_KEYS, "q_share", "alpha_gain", "alpha_gain_lo",
                               "alpha_gain_hi")},
        "gain_verdict": str(rep["gain_verdict"]) if rep is not None else None,
        "alpha_growth": f(growth.get("alpha", math.nan)), "alpha_growth_lo": a_lo,
        "alpha_growth_hi": a_hi, "growth_verdict": judge_third(a_lo, a_hi, band),
        "growth_of": growth_of,
    }


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
