"""The entropy-equivalent inverse temperature of a softmax row (torch only).

``beta_eff(H, n)`` is the beta at which iid Gaussian logits z_i ~ N(0, beta^2) over n options
have, in expectation, softmax entropy H; ``peaked_threshold`` is the random-energy-model
threshold sqrt(2 ln n) both peakedness flags compare to. Owns the tabulated curve E[H](beta, n)
(``compute_curve``, shipped in ``_entropy_curve.py``; regenerate with
``python -m peakprobe.probes.gaussian_entropy``) and its exact per-row inversion
(``_brackets``, ``beta_eff``). How the curve is computed and inverted, its range and its checks:
docs/probes.md, "How beta_eff is computed".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: n up to which full samples are drawn; above it the top values are exact and the rest averaged
EXACT_N = 1024
TOP_K = 512
SEED = 20260301


def peaked_threshold(n: Any) -> Any:
    """The random-energy-model threshold sqrt(2 ln n) on the logit std over n options.

    Works on a Python number, a numpy array or a torch tensor (n >= 1; 0 at n = 1)."""
    if isinstance(n, (int, float)):
        return math.sqrt(2.0 * math.log(n)) if n > 1 else 0.0
    if hasattr(n, "clamp"):  # torch: no numpy round trip, stays on its device
        return (2.0 * n.clamp(min=1).log()).sqrt()
    import numpy as np

    return np.sqrt(2.0 * np.log(np.maximum(n, 1)))


def _n_grid() -> list[int]:
    grid, n = [2, 3], 4
    while n <= 2**18:
        grid += [n, n * 3 // 2] if n * 3 // 2 <= 2**18 and n >= 4 else [n]
        n *= 2
    return sorted(set(grid))


def _b_grid() -> list[float]:
    fine = [round(0.1 * i, 1) for i in range(21)]  # 0 .. 2
    tail = [2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0]
    return fine + tail


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """Softmax entropy of each row of z, (..., n) -> (...)."""
    d = z - z.amax(-1, keepdim=True)
    e = d.exp()
    s = e.sum(-1)
    return s.log() - (e * d).sum(-1) / s


def _curve_exact(n: int, betas: torch.Tensor, samples: int, g: torch.Generator) -> torch.Tensor:
    out = torch.zeros_like(betas)
    per = max(1, (1 << 20) // n)
    done = 0
    while done < samples:
        r = min(per, samples - done)
        x = torch.randn(r, n, generator=g, dtype=torch.float64)  # (R, n)
        for j, beta in enumerate(betas.tolist()):
            out[j] += _entropy(beta * x).sum()
        done += r
    return out / samples


def _top_values(n: int, k: int, samples: int, g: torch.Generator) -> torch.Tensor:
    """The k largest of n iid N(0, 1), descending, (samples, k): the k smallest of n uniforms are
    Gamma_i / Gamma_{n+1} (cumulative sums of unit exponentials); the x are their upper-tail
    quantiles. Gamma_{n+1} - Gamma_k ~ Gamma(n + 1 - k) by Wilson-Hilferty (a >> 1)."""
    e = -torch.rand(samples, k, generator=g, dtype=torch.float64).log()  # Exp(1)
    cum = e.cumsum(-1)  # (R, k)
    a = float(n + 1 - k)
    w = torch.randn(samples, 1, generator=g, dtype=torch.float64)
    rest = a * (1 - 1 / (9 * a) + w * math.sqrt(1 / (9 * a))) ** 3
    tail = cum / (cum[:, -1:] + rest)  # upper-tail probabilities, ascending
    return -torch.special.ndtri(tail)  # (R, k), descending


def _curve_top(n: int, betas: torch.Tensor, samples: int, g: torch.Generator) -> torch.Tensor:
    x = _top_values(n, TOP_K, samples, g)  # (R, K)
    x1, t = x[:, :1], x[:, -1:]  # (R, 1)
    bulk = n - TOP_K
    out = torch.zeros_like(betas)
    d = x - x1
    for j, beta in enumerate(betas.tolist()):
        e = (beta * d).exp()  # (R, K)
        # the bulk below t, relative to e^{beta x1}: (n - K) E[e^{beta x} | x < t] e^{-beta x1}
        log_zb = (
            math.log(bulk) + beta * beta / 2 - beta * x1
            + torch.special.log_ndtr(t - beta) - torch.special.log_ndtr(t)
        )  # fmt: skip
        zb = log_zb.exp()
        mills = (-0.5 * (t - beta) ** 2 - 0.5 * math.log(2 * math.pi) - torch.special.log_ndtr(t - beta)).exp()
        db = beta - x1 - mills  # the bulk's tilted mean of x - x1
        s = e.sum(-1, keepdim=True) + zb
        a = (e * d).sum(-1, keepdim=True) + zb * db
        out[j] = (s.log() - beta * a / s).mean()
    return out


def compute_curve(samples: int = 4096) -> tuple[list[int], list[float], list[list[float]]]:
    """(n grid, b grid, h[n][b] = E[H] / ln n), deterministic (fixed seed)."""
    ns, bs = _n_grid(), _b_grid()
    g = torch.Generator().manual_seed(SEED)
    table = []
    for n in ns:
        betas = torch.tensor(bs, dtype=torch.float64) * math.sqrt(2 * math.log(n))
        if n <= EXACT_N:
            h = _curve_exact(n, betas, max(samples // 4, (1 << 21) // n), g)
        else:
            h = _curve_top(n, betas, samples, g)
        h = (h / math.log(n)).clamp(0.0, 1.0)
        h[0] = 1.0  # beta = 0: uniform, exactly
        h = torch.cummin(h, 0).values  # monotone up to sampling noise in the last digits
        table.append([float(f"{v:.6g}") for v in h.tolist()])
    return ns, bs, table


_TABLE: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def curve_table() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log n grid (Nn,), b grid (Nb,), h (Nn, Nb)) float64, from the shipped table."""
    global _TABLE
    if _TABLE is None:
        from ._entropy_curve import B_GRID, H_TABLE, N_GRID

        _TABLE = (
            torch.tensor(N_GRID, dtype=torch.float64).log(),
            torch.tensor(B_GRID, dtype=torch.float64),
            torch.tensor(H_TABLE, dtype=torch.float64),
        )
    return _TABLE


_BRACKETS: tuple[torch.Tensor, torch.Tensor] | None = None
_STEPS: int | None = None
_CELLS = 1024  # cells of h per interval of the n grid (finer than any knot spacing of h)


def _brackets() -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) int32, flat over (interval of the n grid, cell of h): for any n in the interval
    and any h in the cell, the last knot j where the row's curve is still >= h lies in
    [lo, hi]. The row's curve lies between the interval's two tabulated curves, so lo is where
    the lower of them crosses the cell's top and hi where the upper one crosses its bottom."""
    global _BRACKETS
    if _BRACKETS is None:
        _, _, h = curve_table()
        nb = h.shape[1]
        lower = torch.minimum(h[:-1], h[1:]).unsqueeze(-1)  # (Nn - 1, Nb, 1), decreasing in b
        upper = torch.maximum(h[:-1], h[1:]).unsqueeze(-1)
        edges = torch.arange(_CELLS + 1, dtype=torch.float64) / _CELLS
        lo = (lower >= edges[1:]).sum(1) - 1  # (Nn - 1, cells)
        hi = (upper >= edges[:-1]).sum(1) - 1
        _BRACKETS = tuple(t.clamp(0, nb - 1).to(torch.int32).reshape(-1) for t in (lo, hi))
    return _BRACKETS


def _bracket_steps() -> int:
    """Binary-search steps that resolve the widest bracket of ``_brackets``."""
    global _STEPS
    if _STEPS is None:
        lo, hi = _brackets()
        _STEPS = int((hi - lo).max()).bit_length()
    return _STEPS


_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def on_device(name: str, device: torch.device | str) -> torch.Tensor:
    """A table (``ln_grid``, ``b_grid``, ``h``: ``curve_table``; ``lo``, ``hi``: ``_brackets``)
    on ``device``, copied there once and cached: no host-to-device copy per call."""
    key = (name, torch.device(device))
    if key not in _ON_DEVICE:
        ln_grid, b_grid, h = curve_table()
        lo, hi = _brackets()
        table = {"ln_grid": ln_grid, "b_grid": b_grid, "h": h, "lo": lo, "hi": hi}[name]
        _ON_DEVICE[key] = table.to(device)
    return _ON_DEVICE[key]


def load_tables() -> None:
    """Build every cached table ``beta_eff`` reads (before a ``torch.compile`` trace of it)."""
    curve_table()
    _bracket_steps()


def _curves_at(log_n: torch.Tensor) -> torch.Tensor:
    """The normalised curve h(b) at each log n, linear in log n between grid rows: (..., Nb)."""
    ln_grid, h = on_device("ln_grid", log_n.device), on_device("h", log_n.device)
    x = log_n.clamp(ln_grid[0], ln_grid[-1])
    i = torch.searchsorted(ln_grid, x.contiguous(), right=True).clamp(1, len(ln_grid) - 1)
    w = ((x - ln_grid[i - 1]) / (ln_grid[i] - ln_grid[i - 1])).unsqueeze(-1)
    return h[i - 1] * (1 - w) + h[i] * w


def expected_entropy(beta: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The tabulated E[H] of softmax(beta x), x ~ N(0, I_n), per element (n >= 2)."""
    n = n.to(torch.float64)
    log_n = n.log()
    b_grid = on_device("b_grid", n.device)
    curves = _curves_at(log_n)  # (..., Nb)
    from ._entropy_curve import B_GRID  # a Python float: no read of a device tensor

    b = (beta.to(torch.float64) / peaked_threshold(n)).clamp(0, float(B_GRID[-1]))
    j = torch.searchsorted(b_grid, b.unsqueeze(-1).contiguous(), right=True).clamp(1, len(b_grid) - 1)
    lo, hi = curves.gather(-1, j - 1), curves.gather(-1, j)
    t = (b.unsqueeze(-1) - b_grid[j - 1]) / (b_grid[j] - b_grid[j - 1])
    return ((lo + (hi - lo) * t).squeeze(-1)) * log_n


#: the largest option count with per-n tables (``counts``); above it every row computes its own
PER_N_MAX = 1 << 15


@dataclass(frozen=True)
class PerN:
    """Everything ``beta_eff`` and the peaked flags need from an option count n, tabulated for
    every integer n in [0, size] (float64 unless said): a row then gathers them by its n instead
    of recomputing logs, square roots and the interpolated curve at every step of its search."""

    size: int
    log_n: torch.Tensor  # ln max(n, 2)
    threshold: torch.Tensor  # peaked_threshold(n) (0 for n <= 1)
    threshold2: torch.Tensor  # peaked_threshold(max(n, 2))
    curves: torch.Tensor  # ((size + 1) * stride,) n's normalised curve at the knots, row by row
    stride: int  # Nb, then -inf entries that no h reaches (a search step may overshoot)
    cell_base: torch.Tensor  # int32: n's first entry in ``_brackets`` ((interval - 1) * cells)


_PER_N: dict[tuple[int, torch.device], PerN] = {}


def per_n_tables(n_max: int, device: torch.device | str = "cpu") -> PerN:
    """The ``PerN`` tables for n up to at least n_max (a power of two >= 1024; cached)."""
    size = max(1024, 1 << max(0, int(n_max) - 1).bit_length())
    key = (size, torch.device(device))
    if key not in _PER_N:
        ln_grid, _, table = curve_table()
        n = torch.arange(size + 1, dtype=torch.float64)
        log_n = n.clamp(min=2).log()
        # the same arithmetic as the general path of beta_eff, once per n instead of per row
        x = log_n.clamp(ln_grid[0], ln_grid[-1])
        i = torch.searchsorted(ln_grid, x, right=True).clamp(1, len(ln_grid) - 1)
        w = ((x - ln_grid[i - 1]) / (ln_grid[i] - ln_grid[i - 1])).unsqueeze(-1)  # (size + 1, 1)
        lo_v, hi_v = table[i - 1], table[i]  # (size + 1, Nb)
        pad = torch.full((size + 1, 1 << _bracket_steps()), float("-inf"), dtype=torch.float64)
        curves = torch.cat([lo_v + (hi_v - lo_v) * w, pad], 1)  # (size + 1, stride)
        _PER_N[key] = PerN(
            size=size,
            log_n=log_n.to(device),
            threshold=peaked_threshold(n).to(device),
            threshold2=peaked_threshold(n.clamp(min=2)).to(device),
            curves=curves.reshape(-1).to(device),
            stride=curves.shape[1],
            cell_base=((i - 1) * _CELLS).to(torch.int32).to(device),
        )
    return _PER_N[key]


@dataclass(frozen=True)
class Counts:
    """Functions of each row's option count n (row shape), computed once and shared by every
    statistic that needs them. ``index`` and ``tables`` are set when n has per-n tables."""

    n: torch.Tensor  # float64
    log_n: torch.Tensor  # ln max(n, 2)
    threshold: torch.Tensor  # peaked_threshold(n)
    index: torch.Tensor | None = None  # int64: n itself, a row of ``tables``
    tables: PerN | None = None


def counts(n: torch.Tensor, n_max: int | None = None) -> Counts:
    """``Counts`` of integer-valued option counts n. ``n_max``: a bound on every n, known to the
    caller (e.g. the key length); up to ``PER_N_MAX`` the values come from per-n tables."""
    n = n.to(torch.float64)
    if n_max is None or n_max > PER_N_MAX:
        return Counts(n, n.clamp(min=2).log(), peaked_threshold(n))
    tables = per_n_tables(n_max, n.device)
    k = n.clamp(0, tables.size).to(torch.int64)  # exact: n holds whole numbers
    return Counts(n, _take(tables.log_n, k), _take(tables.threshold, k), k, tables)


def _take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a 1-D table (``index_select``: several times faster than indexing on CPU)."""
    return table.index_select(0, idx.reshape(-1)).view(idx.shape)


def beta_eff(entropy: torch.Tensor, n: torch.Tensor | Counts) -> torch.Tensor:
    """The inverse temperature at which Gaussian logits over n options have this entropy.

    entropy, n: broadcastable (n >= 2 where the result is used; other entries give 0). The
    result is float64, in [0, B_GRID[-1] * sqrt(2 ln n)] (clamped outside the table, see the
    module docstring). Per row, the knot where the row's curve (the two tabulated n around it,
    combined on the fly) crosses h, by a binary search inside the bracket the two tabulated
    curves give, then the root of the linear piece. n may be ``Counts`` (then of entropy's
    shape): with per-n tables, the row's curve is gathered instead of combined."""
    if isinstance(n, Counts):
        if n.tables is not None:
            return _beta_eff_tabled(entropy.to(torch.float64), n)
        n = n.n
    entropy, n = torch.broadcast_tensors(entropy.to(torch.float64), n.to(torch.float64))
    n = n.clamp(min=2)
    log_n = n.log()
    ln_grid, b_grid = on_device("ln_grid", n.device), on_device("b_grid", n.device)
    flat = on_device("h", n.device).reshape(-1)
    nb = b_grid.numel()
    x = log_n.clamp(ln_grid[0], ln_grid[-1])
    i = torch.searchsorted(ln_grid, x.contiguous(), right=True, out_int32=True)
    i = i.clamp(1, len(ln_grid) - 1)
    shape = i.shape

    def take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # table[idx], fast on CPU
        return table.index_select(0, idx.reshape(-1)).view(shape)

    ln0, ln1 = take(ln_grid, i - 1), take(ln_grid, i)
    w = (x - ln0) / (ln1 - ln0)
    row0, row1 = (i - 1) * nb, i * nb

    def curve(j: torch.Tensor) -> torch.Tensor:  # the row's normalised curve at knot j
        lo_v, hi_v = take(flat, row0 + j), take(flat, row1 + j)
        return lo_v + (hi_v - lo_v) * w

    h = entropy / log_n
    # The knot lies in the bracket of the row's (interval, cell of h); a short search inside.
    lo_tab, hi_tab = on_device("lo", n.device), on_device("hi", n.device)
    cell = (h * _CELLS).nan_to_num_(0.0).clamp_(0, _CELLS - 1).to(torch.int32)
    at = (i - 1) * _CELLS + cell
    lo, hi = take(lo_tab, at), take(hi_tab, at)
    # as many steps as the widest bracket of the table needs (not of these rows: a fixed count
    # keeps the compiled path free of a data-dependent loop; converged rows stay put)
    for _ in range(_bracket_steps()):
        mid = (lo + hi + 1) >> 1
        above = curve(mid) >= h
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid - 1)
    j = lo.clamp(max=nb - 2)
    c0, c1 = curve(j), curve(j + 1)
    t = ((c0 - h) / (c0 - c1).clamp(min=1e-300)).clamp(0.0, 1.0)
    b0, b1 = take(b_grid, j), take(b_grid, j + 1)
    b = b0 + (b1 - b0) * t
    b = torch.where(h >= 1.0, torch.zeros_like(b), b)
    return b * peaked_threshold(n)


def _beta_eff_tabled(entropy: torch.Tensor, c: Counts) -> torch.Tensor:
    """``beta_eff`` from per-n tables: the same knot and the same arithmetic (each row's curve
    was interpolated once per n, by the same formula). The search is branch-free: from the
    bracket's low end, try steps of 2^k, ..., 1 and keep each that still has curve >= h (one
    comparison per step; an overshoot lands on a -inf pad or a lower curve value)."""
    t = c.tables
    assert t is not None and c.index is not None
    b_grid = on_device("b_grid", entropy.device)
    nb = b_grid.numel()
    k = c.index
    h = entropy / c.log_n
    lo_tab = on_device("lo", entropy.device)
    cell = (h * _CELLS).nan_to_num_(0.0).clamp_(0, _CELLS - 1).to(torch.int64)
    at = _take(t.cell_base, k) + cell
    pos = _take(lo_tab, at) + k * t.stride  # the bracket's low knot, in ``t.curves``
    for step in reversed(range(_bracket_steps())):
        cand = pos + (1 << step)
        pos = torch.where(_take(t.curves, cand) >= h, cand, pos)
    row = k * t.stride
    j = (pos - row).clamp_(max=nb - 2)
    pos = row + j
    c0, c1 = _take(t.curves, pos), _take(t.curves, pos + 1)
    frac = ((c0 - h) / (c0 - c1).clamp(min=1e-300)).clamp(0.0, 1.0)
    b0, b1 = _take(b_grid, j), _take(b_grid, j + 1)
    b = b0 + (b1 - b0) * frac
    b = torch.where(h >= 1.0, torch.zeros_like(b), b)
    return b * _take(t.threshold2, k)


def _write_table(path: str) -> None:
    ns, bs, table = compute_curve()
    rows = ",\n".join("    (" + ", ".join(repr(v) for v in row) + ",)" for row in table)
    text = (
        '"""Generated by ``python -m peakprobe.probes.gaussian_entropy``: E[H] / ln n of softmax(beta x),\n'
        "x ~ N(0, I_n), at b = beta / sqrt(2 ln n) (B_GRID) for each n (N_GRID). Do not edit.\"\"\"\n\n"
        "# fmt: off\n"
        f"N_GRID = {tuple(ns)!r}\n"
        f"B_GRID = {tuple(bs)!r}\n"
        f"H_TABLE = (\n{rows},\n)\n"
    )
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    import os

    _write_table(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_entropy_curve.py"))
