"""Raw synthetic run directories with planted laws, for the tests (not the package).

`make_run` writes what a sweep writes — ``manifest.json``, one ``checkpoints/<revision>.parquet``
per step (the tidy schema of docs/architecture.md) and, when asked, ``integrity.json`` — and
nothing a fit would write, so the real `peakprobe.fits.fit_run` has to find the planted truth.
Import it from a test as ``from synthetic import make_run`` (pytest puts tests/ on sys.path).

Planted laws (t = step, tau = tau_scale * step):

* each attention head has a kind: ``concentrating`` (logit std beta = 1.6 c0 (t/t_end)^alpha,
  still growing and past the peaked threshold c0 = sqrt(2 ln n) at the end), ``saturated``
  (the same growth smoothly capped at t_end / 100: peaked, flat late), ``diffuse``
  (0.5 c0 (t/t_end)^alpha, never peaked) or ``sink`` (peaked only because it parks on the first
  key: the raw flags say peaked, the ``_xsink`` statistics with the sink left out do not);
* the other metrics are smooth functions of beta: logit_max_minus_mean = beta c0, logit_top_gap
  = beta / 4, peaked = logistic((beta - c0) / (0.1 c0)) (a row fraction), max_prob and entropy
  falling with beta; beta_eff = beta_eff_factor * beta and peaked_entropy likewise from beta_eff;
* the LM head has its own kind (c0 = sqrt(2 ln vocab)) and the loss L0 + c t^-loss_alpha
  (+ loss_c2 t^-loss_alpha2, a second term that makes alpha drift with the window start;
  target_prob = exp(-loss), target_logit_minus_mean = 2 beta);
* gains (G = L(beta=1) - min_beta L(beta)) with known exponents: with R_end = c t_end^-loss_alpha
  the reducible loss at the end, the bottleneck kind (``gains='attention'`` or ``'lm_head'``)
  gets G = gain_share R_end (t/t_end)^-gain_alpha and the other kind G = other_share R_end
  (t/t_end)^-other_alpha. Attention's G is planted on ``attn_all`` (layer = head = -1), split
  over ``attn_layer`` groups by their concentrating heads, and spread over the concentrating
  heads (0.8 G / n_concentrating each); every other head gets null_share R_end (t/t_end)^-1.
  ``head_gains`` overrides single heads with (share, alpha). ``gains=None`` writes no gain
  metrics at all (an older run, or attribution off); ``gain_groups=False`` leaves out the
  attn_layer / attn_all sites.

Every value except the peaked flags gets multiplicative noise (1 + noise N(0, 1)); gains get
``gain_noise``; the loss ``loss_noise`` (both default to ``noise``). ``spikes`` multiplies the loss
at chosen steps; ``duplicates`` makes a revision's results a copy of another's and flags it in
integrity.json (the format of docs/architecture.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from peakprobe import results, vocab
from peakprobe.checkpoints_index import PYTHIA_STEPS

KINDS = ("concentrating", "saturated", "diffuse", "sink")
#: descriptive d loss / d log beta per planted kind (never used by the verdict)
SENSITIVITY = {"concentrating": -0.05, "saturated": -0.002, "diffuse": 0.0, "sink": -0.001}
LM_HEAD_SENSITIVITY = -0.01
TOKENS_PER_STEP = 2_097_152


@dataclass
class PlantedRun:
    """What `make_run` planted."""

    run_dir: Path
    steps: tuple[int, ...]
    kinds: dict[tuple[int, int], str]  # (layer, head) -> kind
    alphas: dict[tuple[int, int], float]  # (layer, head) -> logit_std growth exponent
    lm_head_kind: str
    lm_head_alpha: float
    loss_L0: float
    loss_c: float
    loss_alpha: float
    gains: str | None  # the planted bottleneck kind of the gains, or None (no gains written)
    gain_alphas: dict[tuple[str, int, int], float] = field(default_factory=dict)  # decay exps
    gain_shares: dict[tuple[str, int, int], float] = field(default_factory=dict)  # at t_end
    expected_bottleneck: str = ""  # the verdict a correct fit must give (vocab.BOTTLENECK_*)


def pythia_like_steps(n: int) -> list[int]:
    """``n`` distinct Pythia steps from step 0 to 143000, spread evenly in log index."""
    grid = list(PYTHIA_STEPS)
    if n >= len(grid):
        return grid
    idx = {int(i) for i in np.round(np.geomspace(1, len(grid), n)).astype(int) - 1}
    while len(idx) < n:  # rounding merged some picks: split the widest gap
        s = sorted(idx)
        width, start = max((b - a, a) for a, b in zip(s, s[1:], strict=False))
        idx.add(start + width // 2)
    return [grid[i] for i in sorted(idx)]


def _beta(kind: str, t: np.ndarray, alpha: float, c0: float, t_end: float) -> np.ndarray:
    """Planted logit std over time t (T,)."""
    if kind in ("concentrating", "sink"):
        return 1.6 * c0 * (t / t_end) ** alpha
    if kind == "saturated":
        t_sat = t_end / 100.0
        with np.errstate(divide="ignore"):
            return 1.6 * c0 * ((t / t_sat) ** (-4.0 * alpha) + 1.0) ** -0.25
    if kind == "diffuse":
        return 0.5 * c0 * (t / t_end) ** alpha
    raise ValueError(f"unknown planted kind {kind!r}; use one of {', '.join(KINDS)}")


def _flag(beta: np.ndarray, c0: float) -> np.ndarray:
    """Row fraction above the threshold: a smooth step at beta = c0."""
    return 1.0 / (1.0 + np.exp(-(beta - c0) / (0.1 * c0)))


def _site_metrics(beta: np.ndarray, c0: float, n: int, eff: float) -> dict[str, np.ndarray]:
    """Noise-free metrics of one site as functions of beta (T,)."""
    ratio = beta / c0
    max_prob = 1.0 / n + (1.0 - 1.0 / n) * (1.0 - np.exp(-ratio * ratio))
    entropy = np.log(n) * np.exp(-ratio * ratio) + 1e-3
    return {
        "logit_std": beta,
        "logit_max_minus_mean": beta * c0,
        "logit_top_gap": beta / 4.0,
        vocab.LOGIT_MAX: 3.0 * beta * c0,  # the largest logit: a fixed multiple of the std
        "peaked": _flag(beta, c0),
        "max_prob": max_prob,
        "entropy": entropy,
        "entropy_norm": entropy / np.log(n),
        vocab.BETA_EFF: eff * beta,
        vocab.PEAKED_ENTROPY: _flag(eff * beta, c0),
    }


def make_run(  # noqa: C901 (one builder of every planted quantity; the tests' helpers module splits it)
    run_dir: str | os.PathLike,
    n_layers: int = 2,
    n_heads: int = 4,
    steps: tuple[int, ...] | list[int] | None = None,
    seed: int = 0,
    *,
    n_checkpoints: int | None = None,
    kinds: dict[tuple[int, int], str] | None = None,
    alphas: dict[tuple[int, int], float] | None = None,
    noise: float = 0.01,
    loss_L0: float = 2.0,
    loss_alpha: float = 1.0 / 3.0,
    loss_c: float | None = None,
    loss_noise: float | None = None,
    loss_c2: float = 0.0,
    loss_alpha2: float = 1.0,
    lm_head_kind: str = "saturated",
    lm_head_alpha: float = 1.0 / 3.0,
    lm_beta_eff_factor: float = 1.0,
    beta_eff_factor: float = 1.0,
    gains: str | None = "attention",
    gain_share: float = 0.5,
    gain_alpha: float = 1.0 / 3.0,
    other_share: float = 0.02,
    other_alpha: float = 1.0,
    null_share: float = 0.001,
    head_gains: dict[tuple[int, int], tuple[float, float]] | None = None,
    gain_groups: bool = True,
    gain_noise: float | None = None,
    peaked_entropy: bool = True,
    xsink: bool = True,
    sensitivity: bool = True,
    n_options: int = 256,
    vocab_size: int = 32000,
    with_tau: bool = True,
    tau_scale: float = 1.0,
    spikes: dict[int, float] | None = None,
    duplicates: dict[str, str] | None = None,
    fit_start_step: int | None = None,
    family: str | None = None,
    model: str = "synthetic",
    source: str = "synthetic",
) -> PlantedRun:
    """Write a raw synthetic run directory and return what was planted (module docstring).

    ``steps`` default to the Pythia grid (or ``n_checkpoints`` of it, log-spread). Default kinds
    cycle concentrating / saturated / diffuse over heads (head h is KINDS[h % 3]); default
    growth alphas are 1/3. ``loss_c`` defaults to a reducible loss of L0 / 4 at the last step.
    ``duplicates`` maps a revision to the revision whose weights (hence results) it repeats.
    """
    run_dir = Path(run_dir)
    if steps is None:
        steps = pythia_like_steps(n_checkpoints) if n_checkpoints else PYTHIA_STEPS
    steps = tuple(sorted(int(s) for s in steps))
    if gains not in (None, vocab.BOTTLENECK_ATTENTION, vocab.BOTTLENECK_LM_HEAD, "neither"):
        raise ValueError(f"gains must be None, 'attention', 'lm_head' or 'neither', got {gains!r}")
    rng = np.random.default_rng(seed)
    t = np.array(steps, dtype=np.float64)
    t_pos = np.maximum(t, 1.0)
    t_end = float(t.max())
    kinds = dict(kinds or {})
    alphas = dict(alphas or {})
    for layer in range(n_layers):
        for head in range(n_heads):
            kinds.setdefault((layer, head), KINDS[head % 3])
            alphas.setdefault((layer, head), 1.0 / 3.0)
    if loss_c is None:
        loss_c = 0.25 * loss_L0 * t_end**loss_alpha
    loss_noise = noise if loss_noise is None else loss_noise
    gain_noise = noise if gain_noise is None else gain_noise

    sites: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
    c0_attn = float(np.sqrt(2 * np.log(n_options)))  # sqrt(2 ln n)
    c0_lm = float(np.sqrt(2 * np.log(vocab_size)))
    for (layer, head), kind in sorted(kinds.items()):
        beta = _beta(kind, t, alphas[(layer, head)], c0_attn, t_end)
        m = _site_metrics(beta, c0_attn, n_options, beta_eff_factor)
        m["first_key_prob"] = 0.95 * np.ones_like(t) if kind == "sink" else m["max_prob"] / 10.0
        if xsink:
            beta_x = 0.4 * c0_attn * (t_pos / t_end) ** 0.05 if kind == "sink" else beta
            mx = _site_metrics(beta_x, c0_attn, n_options - 1, beta_eff_factor)
            for name in ("logit_std", "entropy", "max_prob", "peaked", vocab.BETA_EFF,
                         vocab.PEAKED_ENTROPY):
                if peaked_entropy or name not in (vocab.BETA_EFF, vocab.PEAKED_ENTROPY):
                    m[name + vocab.XSINK_SUFFIX] = mx[name]
        if not peaked_entropy:
            del m[vocab.BETA_EFF], m[vocab.PEAKED_ENTROPY]
        if sensitivity:
            m[vocab.SENSITIVITY] = np.full_like(t, SENSITIVITY[kind])
        sites[(vocab.ATTN, layer, head)] = m
    beta_lm = _beta(lm_head_kind, t, lm_head_alpha, c0_lm, t_end)
    lm = _site_metrics(beta_lm, c0_lm, vocab_size, lm_beta_eff_factor)
    if not peaked_entropy:
        del lm[vocab.BETA_EFF], lm[vocab.PEAKED_ENTROPY]
    loss = loss_L0 + loss_c * t_pos**-loss_alpha + loss_c2 * t_pos**-loss_alpha2
    loss = loss * (1.0 + loss_noise * rng.standard_normal(len(t)))
    for step, factor in (spikes or {}).items():
        loss[steps.index(int(step))] *= factor
    lm["loss"] = loss
    lm["target_prob"] = np.exp(-loss)
    lm["target_logit_minus_mean"] = 2.0 * beta_lm
    if sensitivity:
        lm[vocab.SENSITIVITY] = np.full_like(t, LM_HEAD_SENSITIVITY)
    sites[(vocab.LM_HEAD, -1, -1)] = lm

    gain_alphas: dict[tuple[str, int, int], float] = {}
    gain_shares: dict[tuple[str, int, int], float] = {}
    if gains is not None:
        r_end = loss_c * t_end**-loss_alpha

        def law(share: float, alpha: float) -> np.ndarray:
            return share * r_end * (t_pos / t_end) ** -alpha

        attn_is = gains == vocab.BOTTLENECK_ATTENTION
        lm_is = gains == vocab.BOTTLENECK_LM_HEAD
        attn_law = (gain_share, gain_alpha) if attn_is else (other_share, other_alpha)
        lm_law = (gain_share, gain_alpha) if lm_is else (other_share, other_alpha)
        planted = {(vocab.LM_HEAD, -1, -1): lm_law}
        conc = [k for k, v in sorted(kinds.items()) if v == "concentrating"]
        if gain_groups:
            planted[(vocab.ATTN_ALL, -1, -1)] = attn_law
            for layer in range(n_layers):
                share = sum(1 for la, _ in conc if la == layer) / max(len(conc), 1)
                if not conc:
                    share = 1.0 / n_layers
                planted[(vocab.ATTN_LAYER, layer, -1)] = (attn_law[0] * share, attn_law[1])
        for (layer, head) in sorted(kinds):
            if (layer, head) in conc:
                planted[(vocab.ATTN, layer, head)] = (0.8 * attn_law[0] / len(conc), attn_law[1])
            else:
                planted[(vocab.ATTN, layer, head)] = (null_share, 1.0)
        for (layer, head), law_ in (head_gains or {}).items():
            planted[(vocab.ATTN, layer, head)] = law_
        for site, (share, alpha) in planted.items():
            g = law(share, alpha)
            m = sites.setdefault(site, {})
            m[vocab.GAIN] = g
            m[vocab.LOG_BETA_OPT] = 0.1 * np.sqrt(g / r_end)
            m[vocab.CURVATURE] = 4.0 * g
            if sensitivity and site[0] in (vocab.ATTN_LAYER, vocab.ATTN_ALL):
                m[vocab.SENSITIVITY] = -2.0 * g  # heads and the LM head have theirs
            gain_alphas[site] = alpha
            gain_shares[site] = share

    keys, names, values = [], [], []
    for site, m in sites.items():
        for name, v in sorted(m.items()):
            keys.append(site)
            names.append(name)
            values.append(v)
    vals = np.array(values)  # (R, T)
    names_a = np.array(names)
    # the largest logit is planted noise-free, and draws no noise: the other rows get the same
    # noise as in runs planted without it
    noisy = names_a != vocab.LOGIT_MAX
    eps = np.zeros(vals.shape)
    eps[noisy] = rng.standard_normal((int(noisy.sum()), vals.shape[1]))
    exact = np.array([n.startswith("peaked") or n == "loss" for n in names])
    rel = np.where(names_a == vocab.GAIN, gain_noise, noise)
    rel = np.where(exact, 0.0, rel)
    is_sens = names_a == vocab.SENSITIVITY
    vals = np.where(is_sens[:, None], vals + 1e-3 * noise * eps, vals * (1.0 + rel[:, None] * eps))

    revisions = [f"step{s}" for s in steps]
    source_col = {rev: j for j, rev in enumerate(revisions)}
    for rev, orig in (duplicates or {}).items():
        source_col[rev] = revisions.index(orig)  # the same weights give the same results
    tau = t * tau_scale if with_tau else np.full_like(t, np.nan)
    site_kind = [k[0] for k in keys]
    layer_col = np.array([k[1] for k in keys], dtype=np.int64)
    head_col = np.array([k[2] for k in keys], dtype=np.int64)
    checkpoints = []
    for j, (step, rev) in enumerate(zip(steps, revisions, strict=True)):
        frame = pd.DataFrame({
            "model": model, "revision": rev, "step": np.int64(step),
            "tokens": np.int64(step * TOKENS_PER_STEP), "tau": float(tau[j]),
            "site_kind": site_kind, "layer": layer_col, "head": head_col, "metric": names,
            "value": vals[:, source_col[rev]], "n_rows": np.int64(4096),
        })
        results.write_checkpoint(run_dir, rev, frame)
        checkpoints.append({"revision": rev, "step": step, "tokens": step * TOKENS_PER_STEP,
                            "tau": float(tau[j]) if with_tau else None, "path": None})
    manifest = {
        "format": results.FORMAT,
        "model": model,
        "source": source,
        "family": family,
        "fit_start_step": fit_start_step,
        "checkpoints": checkpoints,
        "data": {"spec": "synthetic", "n_windows": 0, "window": 0, "token_hash": ""},
        "probe": {"chunk": 64, "dtype": "float64"},
        "attribution": {"windows": 4} if sensitivity else None,
        "versions": {"peakprobe": "synthetic"},
    }
    results.write_json(run_dir / results.MANIFEST, manifest)
    if duplicates:
        flagged = {rev: {"step": steps[revisions.index(rev)], "duplicates": [orig],
                         "files": ["model.safetensors"], "whole": True}
                   for rev, orig in duplicates.items()}
        results.write_json(run_dir / vocab.INTEGRITY, {
            "format": 1, "hash": "sha256", "rule": "synthetic", "checked": revisions,
            "unchecked": [], "flagged": flagged})

    expected = _expected(kinds, lm_head_kind, gains, xsink, peaked_entropy, lm_beta_eff_factor,
                         beta_eff_factor)
    return PlantedRun(
        run_dir=run_dir, steps=steps, kinds=kinds, alphas=alphas, lm_head_kind=lm_head_kind,
        lm_head_alpha=lm_head_alpha, loss_L0=loss_L0, loss_c=float(loss_c),
        loss_alpha=loss_alpha, gains=gains, gain_alphas=gain_alphas, gain_shares=gain_shares,
        expected_bottleneck=expected,
    )


def _expected(kinds: dict, lm_kind: str, gains: str | None, xsink: bool, entropy: bool,
              lm_eff: float, eff: float) -> str:
    """The verdict the planted run calls for (the planted share defaults are far from 0.1)."""
    def peaked(kind: str, factor: float, sink_counts: bool) -> bool:
        if kind in ("concentrating", "saturated"):
            return True
        if kind == "sink":
            return sink_counts
        return entropy and 0.5 * factor > 1.0  # a diffuse site peaked by beta_eff only

    attn = any(peaked(k, eff, not xsink) for k in kinds.values())
    lm = peaked(lm_kind, lm_eff, True)
    if not (attn or lm):
        return vocab.BOTTLENECK_NONE
    if gains is None or gains == "neither":
        return vocab.BOTTLENECK_UNDETERMINED
    if gains == vocab.BOTTLENECK_ATTENTION:
        return vocab.BOTTLENECK_ATTENTION if attn else vocab.BOTTLENECK_UNDETERMINED
    return vocab.BOTTLENECK_LM_HEAD if lm else vocab.BOTTLENECK_UNDETERMINED
