"""A synthetic run directory with planted growth laws, for tests and benchmarks.

`make_synthetic_run` writes `manifest.json` and one `checkpoints/step<N>.parquet` per step
through `peakprobe.results`, in the tidy schema of docs/architecture.md. Every attention head
is planted as one of three kinds (t = step; tau = step, i.e. a constant learning rate):

* ``concentrating``: logit_std = 1.6 * c0 * (t / t_end)^alpha, still growing at the end and
  past the peaked threshold c0 = sqrt(2 ln n) there;
* ``saturated``: the same growth, smoothly capped at t_end / 100
  (1.6 * c0 * ((t / t_sat)^(-4 alpha) + 1)^(-1/4) with t_sat = t_end / 100): peaked, flat late;
* ``diffuse``: 0.5 * c0 * (t / t_end)^alpha, never peaked.

The other metrics are smooth functions of logit_std (beta): logit_max_minus_mean =
beta * c0, logit_top_gap = beta / 4, peaked = logistic((beta - c0) / (0.1 c0)), max_prob,
entropy and entropy_norm falling with beta, first_key_prob = max_prob / 10. The LM head is
planted the same way (its own kind, c0 = sqrt(2 ln vocab)) and carries the loss
L0 + c t^-loss_alpha, target_prob = exp(-loss) and target_logit_minus_mean = 2 beta.
Sensitivity (d loss / d log beta) is -0.05 for concentrating sites, -0.002 for saturated ones,
0 for diffuse ones, and -0.01 for the LM head. Every value except `peaked` gets multiplicative
noise (1 + noise * N(0, 1)).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from peakprobe import results

KINDS = ("concentrating", "saturated", "diffuse")
SENSITIVITY = {"concentrating": -0.05, "saturated": -0.002, "diffuse": 0.0}
LM_HEAD_SENSITIVITY = -0.01
PYTHIA_STEPS = tuple([0] + [2**i for i in range(10)] + list(range(1000, 143001, 1000)))


@dataclass
class SyntheticRun:
    """What was planted: per attention head (layer, head) its kind and growth exponent."""

    run_dir: Path
    kinds: dict[tuple[int, int], str]
    alphas: dict[tuple[int, int], float]
    lm_head_kind: str
    lm_head_alpha: float
    loss_L0: float
    loss_c: float
    loss_alpha: float
    steps: tuple[int, ...] = field(default_factory=tuple)


def _beta(kind: str, t: np.ndarray, alpha: float, c0: float, t_end: float) -> np.ndarray:
    """Planted logit std over time t (T,)."""
    if kind == "concentrating":
        return 1.6 * c0 * (t / t_end) ** alpha
    if kind == "saturated":
        t_sat = t_end / 100.0
        with np.errstate(divide="ignore"):
            return 1.6 * c0 * ((t / t_sat) ** (-4.0 * alpha) + 1.0) ** -0.25
    if kind == "diffuse":
        return 0.5 * c0 * (t / t_end) ** alpha
    raise ValueError(f"unknown site kind {kind!r}; use one of {', '.join(KINDS)}")


def _site_metrics(beta: np.ndarray, c0: float, n: int) -> dict[str, np.ndarray]:
    """Noise-free metrics of one site as functions of beta (T,)."""
    ratio = beta / c0
    max_prob = 1.0 / n + (1.0 - 1.0 / n) * (1.0 - np.exp(-ratio * ratio))
    entropy = np.log(n) * np.exp(-ratio * ratio) + 1e-3
    return {
        "logit_std": beta,
        "logit_max_minus_mean": beta * c0,
        "logit_top_gap": beta / 4.0,
        "peaked": 1.0 / (1.0 + np.exp(-(beta - c0) / (0.1 * c0))),
        "max_prob": max_prob,
        "entropy": entropy,
        "entropy_norm": entropy / np.log(n),
    }


def make_synthetic_run(
    run_dir: str | os.PathLike,
    n_layers: int,
    n_heads: int,
    steps: tuple[int, ...] | list[int] = PYTHIA_STEPS,
    seed: int = 0,
    *,
    kinds: dict[tuple[int, int], str] | None = None,
    alphas: dict[tuple[int, int], float] | None = None,
    noise: float = 0.01,
    loss_L0: float = 2.0,
    loss_alpha: float = 1.0 / 3.0,
    loss_c: float | None = None,
    lm_head_kind: str = "saturated",
    lm_head_alpha: float = 1.0 / 3.0,
    n_options: int = 256,
    vocab: int = 32000,
    sensitivity: bool = True,
    with_tau: bool = True,
    model: str = "synthetic",
    tokens_per_step: int = 2_097_152,
) -> SyntheticRun:
    """Write a synthetic run directory and return what was planted.

    Default kinds cycle concentrating / saturated / diffuse over heads (head h of every layer is
    KINDS[h % 3]); default alphas are 1/3 for every head. ``loss_c`` defaults to a reducible loss
    of L0 / 4 at the last step. ``sensitivity=False`` leaves the metric out (not measured);
    ``with_tau=False`` writes NaN tau (unknown schedule).
    """
    run_dir = Path(run_dir)
    steps = tuple(sorted(int(s) for s in steps))
    rng = np.random.default_rng(seed)
    t = np.array(steps, dtype=np.float64)
    t_end = float(t.max())
    kinds = dict(kinds or {})
    alphas = dict(alphas or {})
    for layer in range(n_layers):
        for head in range(n_heads):
            kinds.setdefault((layer, head), KINDS[head % len(KINDS)])
            alphas.setdefault((layer, head), 1.0 / 3.0)
    if loss_c is None:
        loss_c = 0.25 * loss_L0 * t_end**loss_alpha

    # per site: (site_kind, layer, head) -> {metric: values over steps (T,)}
    c0_attn = float(np.sqrt(2.0 * np.log(n_options)))
    c0_lm = float(np.sqrt(2.0 * np.log(vocab)))
    sites: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
    for (layer, head), kind in sorted(kinds.items()):
        m = _site_metrics(_beta(kind, t, alphas[(layer, head)], c0_attn, t_end), c0_attn, n_options)
        m["first_key_prob"] = m["max_prob"] / 10.0
        if sensitivity:
            m["sensitivity"] = np.full_like(t, SENSITIVITY[kind])
        sites[("attn", layer, head)] = m
    beta_lm = _beta(lm_head_kind, t, lm_head_alpha, c0_lm, t_end)
    lm = _site_metrics(beta_lm, c0_lm, vocab)
    lm["loss"] = loss_L0 + loss_c * np.maximum(t, 1.0) ** -loss_alpha
    lm["target_prob"] = np.exp(-lm["loss"])
    lm["target_logit_minus_mean"] = 2.0 * beta_lm
    if sensitivity:
        lm["sensitivity"] = np.full_like(t, LM_HEAD_SENSITIVITY)
    sites[("lm_head", -1, -1)] = lm

    keys, metric_names, values = [], [], []
    for (site_kind, layer, head), m in sites.items():
        for name, v in sorted(m.items()):
            keys.append((site_kind, layer, head))
            metric_names.append(name)
            values.append(v)
    vals = np.array(values)  # (R, T)
    eps = rng.standard_normal(vals.shape)
    names = np.array(metric_names)
    relative = ~np.isin(names, ["peaked", "sensitivity"])  # peaked stays exact
    vals = np.where(relative[:, None], vals * (1.0 + noise * eps), vals)
    is_sens = (names == "sensitivity")[:, None]  # additive noise, so zero stays near zero
    vals = np.where(is_sens, vals + 1e-3 * noise * eps, vals)

    tau = t.copy() if with_tau else np.full_like(t, np.nan)
    site_kind = [k[0] for k in keys]
    layer = np.array([k[1] for k in keys], dtype=np.int64)
    head = np.array([k[2] for k in keys], dtype=np.int64)
    checkpoints = []
    for j, step in enumerate(steps):
        revision = f"step{step}"
        frame = pd.DataFrame(
            {
                "model": model,
                "revision": revision,
                "step": np.int64(step),
                "tokens": np.int64(step * tokens_per_step),
                "tau": float(tau[j]),
                "site_kind": site_kind,
                "layer": layer,
                "head": head,
                "metric": metric_names,
                "value": vals[:, j],
                "n_rows": np.int64(4096),
            }
        )
        results.write_checkpoint(run_dir, revision, frame)
        checkpoints.append(
            {"revision": revision, "step": step, "tokens": step * tokens_per_step,
             "tau": float(tau[j]) if with_tau else None, "path": None}
        )
    manifest = {
        "format": results.FORMAT,
        "model": model,
        "source": "synthetic",
        "checkpoints": checkpoints,
        "data": {"spec": "synthetic", "n_windows": 0, "window": 0, "token_hash": ""},
        "probe": {"chunk": 64, "dtype": "float64", "sensitivity": sensitivity},
        "versions": {"peakprobe": "synthetic"},
    }
    results.write_json(run_dir / results.MANIFEST, manifest)
    return SyntheticRun(
        run_dir=run_dir,
        kinds=kinds,
        alphas=alphas,
        lm_head_kind=lm_head_kind,
        lm_head_alpha=lm_head_alpha,
        loss_L0=loss_L0,
        loss_c=float(loss_c),
        loss_alpha=loss_alpha,
        steps=steps,
    )
