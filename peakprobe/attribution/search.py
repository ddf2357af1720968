"""The 1-D searches over x = log beta (pure Python, no torch): ``minimize_log_beta`` (a Newton
jump, then safeguarded parabolic interpolation within [lo, hi]), ``screened_search`` (single
heads: one screening evaluation, optionally on the first half of the windows first, and a search
only where the gain may reach the floor), ``quadratic_estimate`` (G = g0^2 / (2 h)), and
``describe_attribution`` (the manifest's account of the method).

All start from the loss f0 and its exact slope g0 at x = 0; the reported curvature is the
one-sided secant over the first step downhill. A minimum on a bound moves that bound out
(doubling it up to ``EXTEND_LIMIT`` in |log beta|, with ``EXTEND_EVALS`` evaluations of its own);
an interior minimum is checked once against both ends of that reach. The stopping rules and the screen:
docs/attribution.md, "How each number is computed".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

LOG_BETA_BOUNDS = (-3.0, 3.0)
EXTEND_LIMIT = 12.0  # |log beta| a search on a bound extends to (doubling that bound each time)
# evaluations a search on a bound may spend beyond max_evals on moving it out: two a doubling (the
# new bound and the point delta inside it; two doublings take 3 to 12) and the rest to refine a
# minimum found past the old bound to XTOL. Its own allowance, so that a search which spent its
# budget inside the first bounds still extends them.
EXTEND_EVALS = 16
DELTA = 0.05  # the first step, and the span of the secant curvature
SCREEN_POINT = 1.5  # |log beta| of a head's screening evaluation, downhill: half way to the bound
SCREEN_FLAG = 0.5  # a head is searched where its screen promises this fraction of the floor
SCREEN_STOP = 0.1  # the first half of the windows ends a screen promising under this x the floor
HEAD_RTOL = 0.02  # a screened head's search: its gain to about 2%
XTOL = 1e-4  # in log beta; a loss error ~ curvature * XTOL^2 / 2
MAX_EVALS = 40
_GOLD = 0.3819660112501051


@dataclass(frozen=True)
class SearchResult:
    """Outcome of a minimisation (or an estimate) of f(x), x = log beta."""

    x: float  # log beta at the minimum found
    f: float  # the loss there
    f0: float  # the loss at beta = 1
    slope: float  # d f / d x at 0 (given)
    curvature: float  # the secant curvature over [0, x1]
    n_evals: int  # loss evaluations spent (beyond f0)
    at_bound: bool  # the minimum lies on a bound of [lo, hi]
    estimated: bool  # a two-point quadratic estimate, not a search

    @property
    def gain(self) -> float:
        """G = f(0) - min f (>= 0 for a search: x = 0 is among its points)."""
        return self.f0 - self.f


def _secant(f0: float, g0: float, x1: float, f1: float) -> float:
    return 2.0 * (f1 - f0 - g0 * x1) / (x1 * x1)


@dataclass(frozen=True)
class FirstPart:
    """A screen's first look, on the first part of the windows: that part's mean loss at x, at
    0 and its slope at 0; ``complete(x)`` is the loss on all windows at an x already looked at
    (the rest of the windows evaluated, the first part's evaluation reused)."""

    f: Callable[[float], float]
    f0: float
    g0: float
    complete: Callable[[float], float]


def _screen_model(f0: float, g0: float, xs: float, fs: float,
                  bounds: tuple[float, float]) -> tuple[float, float, float]:
    """(x, f, h): the lower of the points seen (0 and xs) and the minimum over ``bounds`` of the
    quadratic model through f0, g0 and f(xs) (its vertex, or the downhill bound when h <= 0);
    h is the model's secant curvature."""
    lo, hi = bounds
    h = _secant(f0, g0, xs, fs)
    x, best = (xs, fs) if fs < f0 else (0.0, f0)
    xv = min(hi, max(lo, -g0 / h)) if h > 0 else (hi if g0 < 0 else lo)
    fv = f0 + g0 * xv + 0.5 * h * xv * xv
    if fv < best:
        x, best = xv, fv
    return x, best, h


def _first_step(g0: float, delta: float) -> float:
    return -math.copysign(delta, g0) if g0 != 0 else delta


def quadratic_estimate(
    f: Callable[[float], float], f0: float, g0: float, *, delta: float = DELTA,
    bounds: tuple[float, float] = LOG_BETA_BOUNDS,
) -> SearchResult:
    """G ~ g0^2 / (2 h) from the exact slope and one evaluation at -sign(g0) * delta.

    h <= 0 has no quadratic minimum: x and f are NaN (gain unknown), except for a site that does
    not move the loss at all (g0 = 0 and f(x1) = f0), whose gain is 0."""
    x1 = _first_step(g0, delta)
    f1 = f(x1)
    h = _secant(f0, g0, x1, f1)
    if not h > 0:
        if g0 == 0 and f1 == f0:
            return SearchResult(0.0, f0, f0, g0, h, 1, False, True)
        return SearchResult(math.nan, math.nan, f0, g0, h, 1, False, True)
    lo, hi = bounds
    x = min(hi, max(lo, -g0 / h))
    return SearchResult(x, f0 + g0 * x + 0.5 * h * x * x, f0, g0, h, 1, x in (lo, hi), True)


def _vertex(p, q, r) -> float | None:
    """x of the vertex of the parabola through three points (x ascending), None if not convex."""
    (x1, f1), (x2, f2), (x3, f3) = p, q, r
    d12, d23 = (f2 - f1) / (x2 - x1), (f3 - f2) / (x3 - x2)
    a = (d23 - d12) / (x3 - x1)  # half the second derivative
    if not a > 0:
        return None
    return 0.5 * (x1 + x2) - d12 / (2 * a)


def _parabola_at(p, q, r, x: float) -> float:
    """Value at x of the parabola through three points (Lagrange form)."""
    (x1, f1), (x2, f2), (x3, f3) = p, q, r
    return (f1 * (x - x2) * (x - x3) / ((x1 - x2) * (x1 - x3))
            + f2 * (x - x1) * (x - x3) / ((x2 - x1) * (x2 - x3))
            + f3 * (x - x1) * (x - x2) / ((x3 - x1) * (x3 - x2)))


def _next_point(pts: dict[float, float], lo: float, hi: float, delta: float, xtol: float,
                ftol: float, moves: list[float], wide: bool = False) -> tuple[float | None, bool]:
    """The next x to evaluate (None: stop) and whether it is the last one. ``moves``: the
    distances of the bracketed proposals so far from the then best point (appended to).
    ``wide``: trust a parabola's promise on any bracket (not only on one narrower than 0.5)."""
    xs = sorted(pts)
    i = min(range(len(xs)), key=lambda j: pts[xs[j]])
    b = xs[i]
    if i == 0 or i == len(xs) - 1:  # no bracket yet
        n = xs[1] if i == 0 else xs[-2]
        if b in (lo, hi):  # on a bound: a boundary minimum unless a point just inside is lower
            if abs(n - b) <= delta * (1 + 1e-9):
                return None, True
            return b + math.copysign(delta, n - b), False
        if pts[b] == pts[n]:  # flat: nothing to follow
            return None, True
        step = b - n
        if len(xs) >= 4:  # extrapolated once already and still downhill: go to the bound
            return (hi if step > 0 else lo), False
        u = b + 2.0 * step
        if len(xs) >= 3:
            far = xs[2] if i == 0 else xs[-3]
            v = _vertex(*sorted([(far, pts[far]), (n, pts[n]), (b, pts[b])]))
            if v is not None and (v - b) * step > 0 and abs(v - b) <= 4 * abs(step):
                u = v
        return min(hi, max(lo, u)), False
    left, right = xs[i - 1], xs[i + 1]
    if right - left < xtol or max(pts[left], pts[right]) - pts[b] < ftol:
        return None, True  # the bracket is narrower than xtol, or flat within the loss's noise
    trio = (left, pts[left]), (b, pts[b]), (right, pts[right])
    v = _vertex(*trio)
    # Brent's safeguard: a parabolic step must be under half the step before last, else the
    # steps creep (a far bracket end) and a golden-section step is taken instead
    creeping = len(moves) >= 2 and v is not None and abs(v - b) > 0.5 * moves[-2]
    if v is not None and left < v < right and not creeping:
        if abs(v - b) < 1e-12:
            return None, True
        last = abs(v - b) < xtol or ((wide or right - left < 0.5) and pts[b] - _parabola_at(*trio, v) < ftol)
        moves.append(abs(v - b))
        return v, last
    gold = b + _GOLD * (right - b) if right - b > b - left else b - _GOLD * (b - left)
    moves.append(abs(gold - b))
    return gold, False


def _lower_far_end(f: Callable[[float], float], pts: dict[float, float], best: float,
                   reach: float) -> float | None:
    """The end of the reach (-reach or reach, both evaluated into ``pts``) whose loss is below
    the best point's, the lower one; None when neither is."""
    for xe in (-reach, reach):
        if xe not in pts:
            pts[xe] = f(xe)
    end = min((-reach, reach), key=pts.get)
    return end if pts[end] < pts[best] else None


def minimize_log_beta(
    f: Callable[[float], float], f0: float, g0: float, *, delta: float = DELTA,
    bounds: tuple[float, float] = LOG_BETA_BOUNDS, xtol: float = XTOL, ftol: float = 0.0,
    max_evals: int = MAX_EVALS, scan: tuple[float, ...] = (), check_bounds: bool = True,
    rtol: float = 0.0, known: dict[float, float] | None = None,
    concave_factor: float | None = None, start: float | None = None,
    extend_to: float = EXTEND_LIMIT, extend_evals: int = EXTEND_EVALS,
) -> SearchResult:
    """Minimise f over x in ``bounds`` starting from f(0) = f0, f'(0) = g0 (see the module doc).

    ``scan``: points evaluated up front (a coarse grid when evaluations are cheap).
    ``check_bounds``: once the local search has converged, evaluate both bounds and, if one is
    lower, continue from it (a minimum on the far side of a maximum near a bound is then found).
    ``ftol``: stop when the parabola promises less than this (the loss's rounding noise).
    ``rtol``: also stop when the parabola promises less than ``rtol`` times the gain found so far
    (the gain to about that relative accuracy, not the minimiser to ``xtol``).
    ``known``: points already evaluated (x -> f(x)); they are used, not counted in ``n_evals``.
    ``concave_factor``: where the secant curvature is <= 0, go on to x1 * concave_factor instead
    of straight to the downhill bound (a basin between x1 and the bound is then not jumped over).
    ``start``: the first point (instead of one step downhill), e.g. where a cheaper look at the
    curve puts the minimum; the secant curvature then spans [0, start].
    ``extend_to``: how far in |log beta| a bound the minimum sits on moves out (the module doc);
    at most the given bounds' magnitude disables it. ``extend_evals``: the evaluations the moves
    out may spend beyond ``max_evals``."""
    r = _bounded_search(f, f0, g0, delta=delta, bounds=bounds, xtol=xtol, ftol=ftol,
                        max_evals=max_evals, scan=scan, check_bounds=check_bounds, rtol=rtol,
                        known=known, concave_factor=concave_factor, start=start)
    pts, h = r
    lo, hi = bounds
    reach = max(-lo, hi) < extend_to
    while True:
        best = min(pts, key=pts.get)
        xs = sorted(pts)
        at_bound = best in (lo, hi) and best in (xs[0], xs[-1])
        spent = len(pts) - 1 - len(known or {})
        if check_bounds and reach and not at_bound and spent < max_evals + extend_evals:
            # an interior minimum: the far ends of the reach once (a deeper basin past a bound
            # that is itself higher, e.g. the hard-attention limit); a lower end moves its bound
            reach = False
            end = _lower_far_end(f, pts, best, extend_to)
            if end is None:
                break
            lo, hi = (-extend_to, hi) if end < 0 else (lo, extend_to)
            pts, _ = _bounded_search(f, f0, g0, delta=delta, bounds=(lo, hi), xtol=xtol, ftol=ftol,
                                     max_evals=max(max_evals + extend_evals - spent - 2, 2), scan=(),
                                     check_bounds=False, rtol=rtol, concave_factor=None, start=end,
                                     known={x: v for x, v in pts.items() if x != 0.0})
            continue
        if not at_bound or abs(best) >= extend_to or spent >= max_evals + extend_evals:
            break
        lo, hi = (max(2 * lo, -extend_to), hi) if best == lo else (lo, min(2 * hi, extend_to))
        budget = max_evals + extend_evals - spent
        pts, _ = _bounded_search(f, f0, g0, delta=delta, bounds=(lo, hi), xtol=xtol, ftol=ftol,
                                 max_evals=budget, scan=(lo if best == lo else hi,),
                                 check_bounds=False, rtol=rtol, concave_factor=None, start=best,
                                 known={x: v for x, v in pts.items() if x != 0.0})
    n_evals = len(pts) - 1 - len({x for x in (known or {}) if x != 0.0})
    return SearchResult(best, pts[best], f0, g0, h, n_evals, at_bound, False)


def _bounded_search(f: Callable[[float], float], f0: float, g0: float, *, delta: float,
                    bounds: tuple[float, float], xtol: float, ftol: float, max_evals: int,
                    scan: tuple[float, ...], check_bounds: bool, rtol: float,
                    known: dict[float, float] | None, concave_factor: float | None,
                    start: float | None) -> tuple[dict[float, float], float]:
    """The search within fixed ``bounds``: every point it evaluated (x -> f(x), 0 and ``known``
    included) and the secant curvature over its first step."""
    lo, hi = bounds
    pts: dict[float, float] = {0.0: f0, **(known or {})}
    spent = len(pts) - 1

    def ev(x: float) -> float:
        x = min(hi, max(lo, x))
        if x not in pts and len(pts) - 1 - spent < max_evals:
            pts[x] = f(x)
        return x

    x1 = ev(_first_step(g0, delta) if start is None else start)
    h = _secant(f0, g0, x1, pts[x1])
    if g0 == 0 and pts[x1] >= f0 and not scan:  # flat at 0: look the other way once
        xm = ev(-x1)
        if pts[xm] >= f0:
            return pts, (pts[x1] + pts[xm] - 2 * f0) / (x1 * x1)
    for x in scan:
        ev(x)
    # Newton from the secant curvature; concave at 0: straight to the downhill bound (or on by
    # concave_factor)
    downhill = (hi if x1 > 0 else lo) if concave_factor is None else x1 * concave_factor
    u: float | None = (-g0 / h if h > 0 else downhill) if not scan else None
    moves: list[float] = []
    for round_ in range(2):
        last = False
        while len(pts) - 1 - spent < max_evals:
            if u is not None:
                ev(u)
            if last:
                break
            tol = max(ftol, rtol * (f0 - min(pts.values())))
            u, last = _next_point(pts, lo, hi, delta, xtol, tol, moves, wide=rtol > 0)
            if u is None:
                break
        if round_ or not check_bounds:
            break
        best = min(pts.values())
        ev(lo), ev(hi)
        if min(pts.values()) >= best:
            break
        u = None
    return pts, h


def _recording(f: Callable[[float], float], seen: dict[float, float]) -> Callable[[float], float]:
    """``f``, each evaluation also kept in ``seen``."""
    def ev(x: float) -> float:
        seen[x] = f(x)
        return seen[x]
    return ev


def screened_search(
    f: Callable[[float], float], f0: float, g0: float, *, floor: float, ftol: float = 0.0,
    max_evals: int = MAX_EVALS, rtol: float = HEAD_RTOL,
    bounds: tuple[float, float] = LOG_BETA_BOUNDS, first: FirstPart | None = None,
) -> SearchResult:
    """A single head's gain: one screening evaluation, and the search only where it may matter.

    The screen evaluates xs = -sign(g0) * SCREEN_POINT, half way to the downhill bound. With f0
    and g0 it gives the secant curvature h over [0, xs] and the minimum of the quadratic model
    through them over [lo, hi] (its vertex, or the downhill bound when h <= 0); the loss seen at
    xs counts too. Where the gain that promises reaches ``SCREEN_FLAG * floor`` the search runs
    from the model's minimum, xs known, with ``rtol`` (the gain to about that relative
    accuracy), both bounds checked (the uphill one too); where its secant is concave it steps on
    by 3x rather than to the bound; a minimum on a bound (checked just inside) is checked once
    more at the midpoint between 0 and the bound, and the search goes on from there when that
    is lower. A head whose promise reaches half that threshold while its loss at xs is above
    f0 (the curve turned back up) gets one more evaluation, at the downhill bound, where a
    second basin behind the rise shows. Below it the head's gain is negligible: the screen's
    figure (``estimated``: the model's minimum, or a point seen where that is lower; below the
    floor). The reported curvature is the screen's secant. Blind spot (measured in
    docs/attribution.md): a deeper basin uphill of x = 0 on a head the screen does not flag.

    ``first``: the screen's evaluation is made on the first part of the windows first. Where the
    same model through that part's f0, g0 and loss at xs promises under ``SCREEN_STOP * floor``
    the screen ends there (``estimated``; the part's figure: its promise as the gain, its
    secant as the curvature). Elsewhere ``first.complete`` gives the loss on all windows at xs
    and the screen goes on as without ``first``: a head that is not stopped gets the same
    figures, bit for bit."""
    lo, hi = bounds
    xb = (hi if g0 < 0 else lo) * SCREEN_POINT / hi
    if first is not None:
        fp = first.f(xb)
        xp, bp, hp = _screen_model(first.f0, first.g0, xb, fp, bounds)
        if not max(abs(fp - first.f0), abs(first.g0 * xb)) >= SCREEN_STOP * floor:
            return SearchResult(xp, f0 - (first.f0 - bp), f0, g0, hp, 1, xp in (lo, hi), True)
        fb = first.complete(xb)
    else:
        fb = f(xb)
    x, best, h = _screen_model(f0, g0, xb, fb, bounds)
    seen: dict[float, float] = {xb: fb}
    if fb > f0 and f0 - best >= 0.5 * floor * SCREEN_FLAG:
        # near the threshold, and the loss turns back up before xs: a second basin behind that
        # rise would show at the downhill bound (one more evaluation)
        xe = hi if g0 < 0 else lo
        seen[xe] = f(xe)
        if seen[xe] < best:
            x, best = xe, seen[xe]
    if not f0 - best >= floor * SCREEN_FLAG:
        return SearchResult(x, best, f0, g0, h, len(seen), x in (lo, hi), True)

    ev = _recording(f, seen)
    kw = dict(bounds=bounds, ftol=ftol, max_evals=max_evals, rtol=rtol, concave_factor=3.0)
    r = minimize_log_beta(ev, f0, g0, start=x if x != 0.0 else xb, known=dict(seen), **kw)
    if r.at_bound:  # a basin between 0 and the bound shows at the midpoint (1 evaluation)
        mid = 0.5 * r.x
        if mid not in seen and ev(mid) < r.f:
            r = minimize_log_beta(ev, f0, g0, start=mid, known=dict(seen), **kw)
    return SearchResult(r.x, r.f, f0, g0, h, len(seen), r.at_bound, False)


def describe_attribution(windows: int, heads: str) -> dict:
    """The attribution method, as recorded in the run manifest."""
    lo, hi = LOG_BETA_BOUNDS
    return {
        "windows": int(windows),
        "loss": "mean next-token cross-entropy over the first `windows` evaluation windows",
        "beta": "multiplies one softmax's logits after scaling/softcapping, before the mask "
                "(and a learned sink logit)",
        "groups": "search: lm_head, attn_layer, attn_all by a secant step, a Newton jump and "
                  f"safeguarded parabolic interpolation on log beta in [{lo:g}, {hi:g}] (xtol "
                  f"{XTOL:g}), then both bounds checked; a minimum on a bound moves it out "
                  f"(doubling, to |log beta| {EXTEND_LIMIT:g}, {EXTEND_EVALS} more evaluations "
                  "at most); lm_head after a 13-point scan",
        "heads": {
            "screen": f"screen: the loss at -sign(g) * {SCREEN_POINT:g}, on the first half of the "
                      "windows first (a head whose quadratic model there promises under "
                      f"{SCREEN_STOP:g} x the floor stops with that half's figure), then on all; "
                      "where it or the quadratic "
                      f"model through it and the slope promises {SCREEN_FLAG:g} x the floor "
                      "(HEAD_GAIN_FLOOR x L), the search from the model's minimum (gain to "
                      f"{HEAD_RTOL:g} relative, both bounds checked, a minimum on a bound checked "
                      "just inside and at the midpoint; a head within half of that whose loss at "
                      "the screen point is above L(0) gets one more look, at the downhill bound); "
                      "elsewhere the screen's figure (below the floor)",
            "estimate": "estimate: G = g^2 / (2 h), g by autograd, h the secant over "
                        f"[0, -sign(g) * {DELTA:g}]; gain NaN where h <= 0",
            "search": "search, as the groups",
            "off": "sensitivity only",
        }[heads],
        "curvature": "lm_head closed form; attention the secant over [0, -sign(g) * "
                     f"{SCREEN_POINT if heads == 'screen' else DELTA:g}] for single heads, over "
                     f"[0, -sign(g) * {DELTA:g}] for groups",
    }
