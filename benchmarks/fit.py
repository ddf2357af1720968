"""Benchmark `peakprobe.fits.fit_run` on a Pythia-1.4b-shaped synthetic run.

24 layers x 16 heads + the LM head, the 154 Pythia checkpoints, every metric of the results
contract (peakedness by logit std and by entropy, sink-excluded statistics, the gains of every
head, layer group, all heads and the LM head), 1,000 bootstrap resamples per fit. The raw run
is written by ``planted_run.py`` beside this script. Target: under 60 s on 2 cores.

Baseline, measured in the same process: the obvious implementation, one
`scipy.optimize.least_squares(loss="huber")` call per bootstrap resample (same Huber loss,
same resampled data), timed on a few resamples of a few series and extrapolated to the number
of resamples fit_run solves. The printed ratio is baseline / vectorised.

    python benchmarks/fit.py [--layers 24 --heads 16 --n-boot 1000 --baseline-resamples 40]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from planted_run import write_run
from scipy.optimize import least_squares

from peakprobe import results
from peakprobe.config import FitConfig
from peakprobe.fits import fit_run
from peakprobe.fits.common import bootstrap_draws, resampled_errors
from peakprobe.fits.growth import (
    BLOCK_ELEMS,
    BOOT_ITERS,
    fit_power_law_many,
    huber_lines,
)


def naive_bootstrap_slopes(t: np.ndarray, y: np.ndarray, n_resamples: int, seed: int,
                           delta: float = 1e-3) -> tuple[float, np.ndarray, np.ndarray]:
    """Per-resample scipy fits of the first n_resamples smoothed-bootstrap resamples of one
    series; returns (seconds, naive slopes, vectorised slopes of the same resamples)."""
    x = np.log(t) - np.log(t).mean()
    ly = np.log(y)
    p = huber_lines(x, ly[None, :], delta, max_iter=2000)[0]
    res = ly - (p[0] + p[1] * x)
    idx, z = bootstrap_draws(len(t), n_resamples, seed)
    errs = resampled_errors(res[None, :], idx, z)[0]  # (B, n)
    start = time.perf_counter()
    naive = np.empty(n_resamples)
    for b in range(n_resamples):
        fit = least_squares(lambda q, e=errs[b]: e - q[0] - q[1] * x, np.zeros(2),
                            loss="huber", f_scale=delta, xtol=1e-12, ftol=1e-12, gtol=1e-12)
        naive[b] = fit.x[1]
    seconds = time.perf_counter() - start
    fast = huber_lines(x, errs, delta, max_iter=BOOT_ITERS, tol=1e-7,
                       start=np.zeros((n_resamples, 2)), dtype=np.float32)[:, 1]
    return seconds, naive, fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--noise", type=float, default=0.01)
    ap.add_argument("--baseline-series", type=int, default=3)
    ap.add_argument("--baseline-resamples", type=int, default=40)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_run(tmp, args.layers, args.heads, seed=0, noise=args.noise)
        t_make = time.perf_counter() - t0
        t0 = time.perf_counter()
        df = results.read_results(tmp)
        t_read = time.perf_counter() - t0

        t0 = time.perf_counter()
        cpu0 = time.process_time()
        rf = fit_run(tmp, FitConfig(n_boot=args.n_boot, seed=0))
        t_fit = time.perf_counter() - t0
        cpu_fit = time.process_time() - cpu0

        # the growth series of the run, to time the baseline on real rows
        table = rf.table
        n_growth = int((table["fit"] != "loss").sum())  # growth and gain fits
        n_late = int((table["metric"] == "logit_std").sum())
        n_scan = len(rf.verdict["loss_scan"]["rows"])
        n_sites = len(rf.sites)
        n_points = rf.n_points
        std = df[(df["metric"] == "logit_std") & (df["site_kind"] == "attn")]
        steps = np.array(sorted(std["step"].unique()))
        t_win = steps[steps >= 0.01 * steps.max()].astype(float)
        series = (std[std["step"].isin(t_win)].sort_values(["layer", "head", "step"])
                  ["value"].to_numpy().reshape(-1, len(t_win)))

    # vectorised growth-fit throughput alone on the same series (no I/O, no loss fit)
    t0 = time.perf_counter()
    fit_power_law_many(t_win, series[:64], n_boot=args.n_boot, seed=0)
    t_vec64 = time.perf_counter() - t0

    base_s, agree = 0.0, []
    for s in range(args.baseline_series):
        sec, naive, fast = naive_bootstrap_slopes(t_win, series[s], args.baseline_resamples, s)
        base_s += sec
        agree.append(np.max(np.abs(naive - fast)))
    per_resample = base_s / (args.baseline_series * args.baseline_resamples)
    n_resample_fits = (n_growth + n_late) * args.n_boot
    baseline_total = per_resample * n_resample_fits

    print(f"shape: {args.layers} layers x {args.heads} heads + LM head, {len(steps)} checkpoints "
          f"({n_points} in the fit window), {args.n_boot} resamples per fit")
    print(f"setup: synthetic run written in {t_make:.1f} s, read back in {t_read:.1f} s")
    print(f"fit_run: {t_fit:.1f} s wall, {cpu_fit:.1f} s CPU for {n_growth} growth + gain fits + "
          f"{n_late} late logit_std fits + 1 loss fit + {n_scan} loss-scan fits "
          f"({'PASS' if t_fit < 60 else 'FAIL'} vs the 60 s target)")
    print(f"verdict: {rf.verdict['bottleneck']['verdict']}; loss alpha {rf.loss.alpha:.3f} "
          f"[{rf.loss.alpha_lo:.3f}, {rf.loss.alpha_hi:.3f}] -> {rf.verdict['loss']['verdict']}")
    print(f"  per site: {1e3 * t_fit / n_sites:.1f} ms; per fit: "
          f"{1e3 * t_fit / (n_growth + n_late + 1):.2f} ms; per resample refit: "
          f"{1e6 * t_fit / n_resample_fits:.2f} us")
    print(f"  growth fits alone (64 series, no I/O): {1e3 * t_vec64 / 64:.2f} ms per fit "
          f"(IRLS blocks of {BLOCK_ELEMS} elements, at most {BOOT_ITERS} steps per refit)")
    print(f"baseline: least_squares(loss='huber') per resample: {1e3 * per_resample:.2f} ms "
          f"(measured on {args.baseline_series} x {args.baseline_resamples} resamples); "
          f"extrapolated to {n_resample_fits} resamples: {baseline_total:.0f} s")
    print(f"ratio baseline / fit_run: {baseline_total / t_fit:.0f}x; "
          f"max |slope difference| naive vs vectorised on the same resamples: {max(agree):.1e}")


if __name__ == "__main__":
    main()
