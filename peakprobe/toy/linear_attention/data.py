"""Data-size law of the linear-attention toy: a finite training set reused over epochs.

Every replica draws its own training set of D sequences and trains on it by full-batch gradient
descent (one step = one epoch; ``sim.train_dataset``) for tau = lr * steps =
``tau_per_seq`` * D. The loss reported is the population loss of the trained weights (exact
for given modes, ``population_loss``), i.e. the loss on fresh data. Features the set never shows
keep their initial s_k ~ 0; the others converge to the set's own optimum A_k / B_k.

The reduced dynamics of each replica's set are one closed-form mode per feature
(``mode_exact`` with rate A_k / D and r_k = B_k / A_k, from s = 0, Delta = 4 sigma0^4), on the
very same sets, so the comparison of the curves is conditional on the data. Derivation of the
law, L(D) - 1/(N+2) ~ D^-(a/(1+a)) at a fixed tau / D: docs/linear_attention.md, section 9.

Public names: ``DATA_FULL``, ``DATA_QUICK``, ``DataRun``, ``run_data``, ``data_law``,
``unseen_mass_asymptote``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from peakprobe.toy.linear_attention.config import DEFAULT
from peakprobe.toy.linear_attention.laws import Exponent, LawResult, fit_exponent
from peakprobe.toy.linear_attention.sim import draw_dataset, train_dataset
from peakprobe.toy.linear_attention.theory import (
    context_r,
    feature_probs,
    mode_exact,
    population_loss,
    predicted_exponents,
)

__all__ = ["DATA_FULL", "DATA_QUICK", "DataRun", "data_law", "run_data", "unseen_mass_asymptote"]

# lr 0.5: full-batch GD at lr 1 is unstable for sets whose feature-1 rate A_1 / D exceeds 1
# (a few per cent of the small sets). tau_per_seq = 20: the rarest features a set shows (once)
# are half learned at tau ~ 2.6 D, so tau = 20 D leaves only those with a small g_q^2 unlearned.
DATA_FULL = dict(model_size=64, sizes=(32, 45, 64, 91, 128, 181, 256, 362, 512), replicas=96,
                 tau_per_seq=20.0, lr=0.5, n_eval=24)
DATA_QUICK = dict(model_size=64, sizes=(32, 64, 128, 256), replicas=16, tau_per_seq=20.0,
                  lr=0.5, n_eval=16)


@dataclass
class DataRun:
    """Per training-set size D: population loss curves of simulation and reduced dynamics."""

    sizes: tuple[int, ...]
    tau: list[np.ndarray]  # per D: (E,) lr * step of the evaluations
    loss_sim: list[np.ndarray]  # per D: (E, replicas) population loss of the trained weights
    loss_reduced: list[np.ndarray]  # per D: (E, replicas) reduced dynamics on the same sets
    train_loss: list[np.ndarray]  # per D: (E,) mean loss on the training set itself
    seen: np.ndarray  # (len(sizes),) mean number of distinct visible features in a set
    fresh_tau: np.ndarray  # (F,) tau grid of the fresh-data reduced curve
    fresh_reduced: np.ndarray  # (F,) population loss of gradient flow on fresh data
    floor: float
    config: dict
    wall_s: float
    fresh_sim: tuple[np.ndarray, np.ndarray] | None = None  # (tau, loss) of fresh SGD, if run


def unseen_mass_asymptote(n_seq: np.ndarray, zipf_a: float, probs: np.ndarray, target: float) -> np.ndarray:
    """Large-D value of (s*/2) sum_k p_k (1 - p_k)^D, the loss of the features the set never
    shows: (s*/2) Gamma(a/(1+a)) / ((1+a) Z^(1/(1+a))) D^-(a/(1+a)), Z from p_1 = 1/Z."""
    a = float(zipf_a)
    z = 1.0 / probs[0]
    coef = 0.5 * target * math.gamma(a / (1.0 + a)) / ((1.0 + a) * z ** (1.0 / (1.0 + a)))
    return coef * np.asarray(n_seq, dtype=np.float64) ** (-a / (1.0 + a))


def _reduced_on_sets(tau: np.ndarray, a_sum: np.ndarray, b_sum: np.ndarray, n_seq: int,
                     probs: np.ndarray, r: float, init_scale: float) -> np.ndarray:
    """Population loss (E, replicas) of the closed-form modes on each replica's own set."""
    replicas, m = a_sum.shape
    seen = a_sum > 0
    rate = (a_sum / n_seq).ravel()  # (replicas * M,), 0 for unseen features: s stays at 0
    r_k = np.where(seen, b_sum / np.where(seen, a_sum, 1.0), 1.0).ravel()
    s = mode_exact(tau, rate, r=r_k, s0=0.0, delta=(2.0 * init_scale**2) ** 2)  # (E, replicas*M)
    return population_loss(s.reshape(len(tau), replicas, m), probs, r)


def run_data(*, model_size: int, sizes: tuple[int, ...], replicas: int, tau_per_seq: float,
             lr: float, n_eval: int, n_features: int = DEFAULT.n_features,
             zipf_a: float = DEFAULT.zipf_a, context: float = DEFAULT.context,
             init_scale: float = DEFAULT.init_scale, init: str = DEFAULT.init, seed: int = 0,
             progress: bool = False, threads: int | None = 1) -> DataRun:
    """Train every replica on its own set of D sequences for each D in ``sizes``. ``threads``
    caps torch's intra-op threads during the run (small tensors: one thread is fastest)."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        return _run_data(model_size, sizes, replicas, tau_per_seq, lr, n_eval, n_features, zipf_a,
                         context, init_scale, init, seed, progress)
    finally:
        torch.set_num_threads(old)


def _run_data(model_size: int, sizes: tuple[int, ...], replicas: int, tau_per_seq: float, lr: float,
              n_eval: int, n_features: int, zipf_a: float, context: float, init_scale: float,
              init: str, seed: int, progress: bool) -> DataRun:
    probs = feature_probs(n_features, zipf_a)
    r = context_r(context)
    start = time.perf_counter()
    taus, sims, reds, trains, seen = [], [], [], [], []
    for n_seq in tqdm(sizes, disable=not progress, desc="linear attention data sizes"):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(n_seq), 104729]))
        a_sum, b_sum, c_sum, counts = draw_dataset(rng, int(n_seq), replicas, probs, model_size, context)
        steps = int(round(tau_per_seq * n_seq / lr))
        evals = np.unique(np.round(np.concatenate([[0], np.geomspace(1, steps, n_eval - 1)])).astype(np.int64))
        run = train_dataset(a_sum, b_sum, c_sum, int(n_seq), steps=steps, lr=lr,
                            init_scale=init_scale, init=init, eval_steps=evals, seed=seed)
        tau = lr * evals.astype(np.float64)
        taus.append(tau)
        sims.append(population_loss(run.modes, probs, r))  # (E, replicas)
        reds.append(_reduced_on_sets(tau, a_sum, b_sum, int(n_seq), probs, r, init_scale))
        train = run.train_loss.mean(axis=0)  # (steps,)
        trains.append(np.append(train, np.nan)[np.minimum(evals, steps)])
        seen.append(float((counts > 0).sum(axis=1).mean()))
    fresh_tau = np.geomspace(1.0, tau_per_seq * max(sizes), 200)
    s_fresh = mode_exact(fresh_tau, probs[:model_size], r=r, s0=0.0, delta=(2.0 * init_scale**2) ** 2)
    config = dict(model_size=model_size, sizes=list(sizes), replicas=replicas, tau_per_seq=tau_per_seq,
                  lr=lr, n_eval=n_eval, n_features=n_features, zipf_a=zipf_a, context=context,
                  init_scale=init_scale, init=init, seed=seed, optimizer="full-batch GD")
    return DataRun(tuple(sizes), taus, sims, reds, trains, np.array(seen), fresh_tau,
                   population_loss(s_fresh, probs, r), 0.5 * (1.0 - 1.0 / r), config,
                   time.perf_counter() - start)


def data_law(*, quick: bool = False, seed: int = 0, progress: bool = False, fresh: object = None,
             settings: dict | None = None, n_boot: int = 1000) -> tuple[LawResult, DataRun]:
    """Run the data-size experiment and fit L(D) - 1/(N+2) ~ D^-alpha at the final tau = c D.

    ``fresh``: a ``LinearAttentionComparison`` whose largest size equals the data model's; its
    simulated fresh-data curve is then drawn next to the finite sets (plot only).
    """
    cfg = dict(settings or (DATA_QUICK if quick else DATA_FULL))
    run = run_data(**cfg, seed=seed, progress=progress)
    sizes = np.asarray(run.sizes, dtype=np.float64)
    final_sim = np.array([v[-1].mean() for v in run.loss_sim]) - run.floor
    final_red = np.array([v[-1].mean() for v in run.loss_reduced]) - run.floor
    a_s, lo_s, hi_s, c_s = fit_exponent(sizes, final_sim, n_boot=n_boot, seed=seed)
    a_r, _, _, c_r = fit_exponent(sizes, final_red, n_boot=n_boot, seed=seed)
    theory = predicted_exponents(run.config["zipf_a"])
    exp = Exponent("data", f"L - 1/(N+2) ~ D^-alpha at tau = {cfg['tau_per_seq']:g} D", a_s, lo_s,
                   hi_s, a_r, theory["data"])
    if fresh is not None and max(fresh.simulation.model_sizes) == cfg["model_size"]:
        i = int(np.argmax(fresh.simulation.model_sizes))
        lr_sweep = fresh.simulation.config["lr"]
        run.fresh_sim = (lr_sweep * fresh.simulation.t, fresh.simulation.loss[i].mean(axis=0))
    details = {"sizes": list(run.sizes), "final_reducible_sim": final_sim,
               "final_reducible_reduced": final_red, "c_sim": c_s, "c_reduced": c_r,
               "distinct_features_seen": run.seen, "config": run.config}
    return LawResult("data", "data size", [exp], "linear_attention_data.png", run.wall_s,
                     details), run
