"""The 1-D minimisation of a loss over x = log beta, and the two-point quadratic estimate.

Both start from what is known at x = 0 (beta = 1): the loss f0 and its exact slope g0 (autograd
or closed form). The first evaluation is always one small step ``delta`` downhill, x1 =
-sign(g0) * delta; with f0 and g0 it gives the one-sided secant curvature
h = 2 (f(x1) - f0 - g0 x1) / x1^2, the curvature that is reported.

``quadratic_estimate`` stops there: G = g0^2 / (2 h), x* = -g0 / h (clipped to the bounds).
``minimize_log_beta`` goes on: a Newton jump x = -g0 / h (straight to the downhill bound when
h <= 0), then safeguarded successive parabolic interpolation through the bracketing triple
around the best point (golden-section steps when a parabola is concave or lands outside the
bracket; downhill while no bracket exists, one extrapolation step and then the bound itself),
until the parabola's vertex lies within ``xtol`` of the best point or promises less than
``ftol``, or the bracket's ends lie within ``ftol`` of the best point; a best point on a bound is
checked once against the point ``delta`` inside it; then both bounds are evaluated and the
search continues from a bound that is lower. The search never
leaves [lo, hi]; a minimum on a bound is reported as such (``at_bound``), its gain a lower bound.
Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

LOG_BETA_BOUNDS = (-3.0, 3.0)
DELTA = 0.05  # the first step, and the span of the secant curvature
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
                ftol: float, moves: list[float]) -> tuple[float | None, bool]:
    """The next x to evaluate (None: stop) and whether it is the last one. ``moves``: the
    distances of the bracketed proposals so far from the then best point (appended to)."""
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
        last = abs(v - b) < xtol or (right - left < 0.5 and pts[b] - _parabola_at(*trio, v) < ftol)
        moves.append(abs(v - b))
        return v, last
    gold = b + _GOLD * (right - b) if right - b > b - left else b - _GOLD * (b - left)
    moves.append(abs(gold - b))
    return gold, False


def minimize_log_beta(
    f: Callable[[float], float], f0: float, g0: float, *, delta: float = DELTA,
    bounds: tuple[float, float] = LOG_BETA_BOUNDS, xtol: float = XTOL, ftol: float = 0.0,
    max_evals: int = MAX_EVALS, scan: tuple[float, ...] = (), check_bounds: bool = True,
) -> SearchResult:
    """Minimise f over x in ``bounds`` starting from f(0) = f0, f'(0) = g0 (see the module doc).

    ``scan``: points evaluated up front (a coarse grid when evaluations are cheap).
    ``check_bounds``: once the local search has converged, evaluate both bounds and, if one is
    lower, continue from it (a minimum on the far side of a maximum near a bound is then found).
    ``ftol``: stop when the parabola promises less than this (the loss's rounding noise)."""
    lo, hi = bounds
    pts: dict[float, float] = {0.0: f0}

    def ev(x: float) -> float:
        x = min(hi, max(lo, x))
        if x not in pts and len(pts) - 1 < max_evals:
            pts[x] = f(x)
        return x

    x1 = ev(_first_step(g0, delta))
    h = _secant(f0, g0, x1, pts[x1])
    if g0 == 0 and pts[x1] >= f0 and not scan:  # flat at 0: look the other way once
        xm = ev(-x1)
        if pts[xm] >= f0:
            h = (pts[x1] + pts[xm] - 2 * f0) / (delta * delta)
            return SearchResult(0.0, f0, f0, g0, h, len(pts) - 1, False, False)
    for x in scan:
        ev(x)
    # Newton from the secant curvature; concave at 0: straight to the downhill bound
    u: float | None = (-g0 / h if h > 0 else (hi if x1 > 0 else lo)) if not scan else None
    moves: list[float] = []
    for round_ in range(2):
        last = False
        while len(pts) - 1 < max_evals:
            if u is not None:
                ev(u)
            if last:
                break
            u, last = _next_point(pts, lo, hi, delta, xtol, ftol, moves)
            if u is None:
                break
        if round_ or not check_bounds:
            break
        best = min(pts.values())
        ev(lo), ev(hi)
        if min(pts.values()) >= best:
            break
        u = None
    best = min(pts, key=pts.get)
    xs = sorted(pts)
    at_bound = best in (lo, hi) and best in (xs[0], xs[-1])
    return SearchResult(best, pts[best], f0, g0, h, len(pts) - 1, at_bound, False)


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
                  f"{XTOL:g}), then both bounds checked; lm_head after a 13-point scan",
        "heads": {
            "estimate": "estimate: G = g^2 / (2 h), g by autograd, h the secant over "
                        f"[0, -sign(g) * {DELTA:g}]; gain NaN where h <= 0",
            "search": "search, as the groups",
            "off": "sensitivity only",
        }[heads],
        "curvature": f"lm_head closed form; attention the secant over [0, -sign(g) * {DELTA:g}]",
    }
