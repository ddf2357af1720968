"""The mergeable per-row sums of a softmax's logits (``Sums``) and their exact algebra.

A row's options may come in parts (key ranges, the first visible key, a learned sink logit);
each part is reduced to ``Sums`` (``rows``' block passes) and the parts are merged exactly, as
flash attention's online softmax rescales its partial sums: no cancellation, any order. Raw
block sums are brought to the conventions of empty and one-option rows by ``normalized``.
Statistics are derived from merged sums by ``rows.finish``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sums:
    """Mergeable per-row sums of one part of a row's options (float64 once ``normalized``; each
    field of the row shape or broadcastable to it, e.g. (1, 1, T) counts of causal rows).

    ``m`` is the part's max (-inf when empty), ``m2`` its second largest (a tied max counts
    twice, like ``topk``), ``s = sum e^(z-m)``, ``a = sum e^(z-m) (z-m)``, ``d1 = sum (z-m)``,
    ``d2 = sum (z-m)^2``; ``n`` the option count. Empty parts have s = a = d1 = d2 = 0.
    """

    n: torch.Tensor
    m: torch.Tensor
    m2: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor
    d1: torch.Tensor
    d2: torch.Tensor


def normalized(r: Sums) -> Sums:
    """float64 ``Sums`` with the conventions of empty rows (m = m2 = -inf, sums 0) and of
    one-option rows (m2 = -inf) applied to raw sums."""
    f64 = torch.float64
    n = r.n.to(f64)
    has, two = n > 0, n > 1
    ninf = torch.tensor(float("-inf"), dtype=f64, device=n.device)
    zero = torch.zeros((), dtype=f64, device=n.device)
    return Sums(
        n,
        torch.where(has, r.m.to(f64), ninf),
        torch.where(two, r.m2.to(f64), ninf),
        torch.where(has, r.s.to(f64), zero),
        torch.where(has, r.a.to(f64), zero),
        torch.where(has, r.d1.to(f64), zero),
        torch.where(has, r.d2.to(f64), zero),
    )


def single(z: torch.Tensor, present: torch.Tensor | None = None) -> Sums:
    """``Sums`` of one option per row with logit z (row shape); ``present`` False: empty."""
    z = z.to(torch.float64)
    n = torch.ones_like(z) if present is None else present.to(torch.float64).expand_as(z)
    ninf = torch.full_like(z, float("-inf"))
    zero = torch.zeros_like(z)
    return Sums(n, torch.where(n > 0, z, ninf), ninf, n.clone(), zero, zero, zero)


def merge(x: Sums, y: Sums) -> Sums:
    """The ``Sums`` of the union of two disjoint parts of each row (exact, no cancellation)."""
    m = torch.maximum(x.m, y.m)
    n = x.n + y.n
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    m_safe = torch.where(n > 0, m, zero)  # m is finite exactly where a part has options
    dx = torch.where(x.n > 0, x.m - m_safe, zero)  # <= 0
    dy = torch.where(y.n > 0, y.m - m_safe, zero)
    ex, ey = dx.exp(), dy.exp()
    return Sums(
        n=n,
        m=m,
        m2=torch.maximum(torch.minimum(x.m, y.m), torch.maximum(x.m2, y.m2)),
        s=x.s * ex + y.s * ey,
        a=ex * (x.a + dx * x.s) + ey * (y.a + dy * y.s),
        d1=x.d1 + x.n * dx + y.d1 + y.n * dy,
        d2=x.d2 + 2 * dx * x.d1 + x.n * dx * dx + y.d2 + 2 * dy * y.d1 + y.n * dy * dy,
    )


def merge_one(x: Sums, z: torch.Tensor, present: torch.Tensor | None = None) -> Sums:
    """``merge(x, single(z, present))`` without the single option's zero sums: the same
    values, bit for bit for finite z, in about half the per-row operations."""
    z = z.to(torch.float64)
    if present is None:  # the option is in every row: no presence masks (the same arithmetic)
        m = torch.maximum(x.m, z)
        dx = torch.where(x.n > 0, x.m - m, torch.zeros((), dtype=m.dtype, device=m.device))  # <= 0
        dy = z - m
        ex, ey = dx.exp(), dy.exp()
        return Sums(n=x.n + 1, m=m, m2=torch.maximum(torch.minimum(x.m, z), x.m2), s=x.s * ex + ey,
                    a=ex * (x.a + dx * x.s) + ey * dy, d1=x.d1 + x.n * dx + dy,
                    d2=x.d2 + 2 * dx * x.d1 + x.n * dx * dx + dy * dy)
    yn = present.to(torch.float64)
    ym = torch.where(yn > 0, z, torch.full((), float("-inf"), dtype=z.dtype, device=z.device))
    m = torch.maximum(x.m, ym)
    n = x.n + yn
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    m_safe = torch.where(n > 0, m, zero)  # m is finite exactly where the row has an option
    dx = torch.where(x.n > 0, x.m - m_safe, zero)  # <= 0
    dy = torch.where(yn > 0, ym - m_safe, zero)
    ex, ey = dx.exp(), dy.exp()
    ny_dy = yn * dy
    return Sums(
        n=n,
        m=m,
        m2=torch.maximum(torch.minimum(x.m, ym), x.m2),
        s=x.s * ex + yn * ey,
        a=ex * (x.a + dx * x.s) + ey * ny_dy,
        d1=x.d1 + x.n * dx + ny_dy,
        d2=x.d2 + 2 * dx * x.d1 + x.n * dx * dx + ny_dy * dy,
    )
