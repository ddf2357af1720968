"""A raw run directory with planted laws, for the benchmarks (``fit.py``, ``report.py``).

``write_run`` writes what a sweep writes (``manifest.json``, one ``checkpoints/step<N>.parquet``
per step in the tidy schema of docs/architecture.md, ``integrity.json`` when a checkpoint
duplicates another) with every metric of the results contract, through the package alone:

* attention heads cycle concentrating (logit std 1.6 c0 (t/t_end)^(1/3), c0 = sqrt(2 ln n)),
  saturated (the same growth capped at t_end / 100) and diffuse (0.5 c0 (t/t_end)^(1/3));
  the other statistics are smooth functions of the logit std, with their sink-excluded twins;
* the LM head's loss is 2 + c t^(-1/3), with a reducible loss of 0.5 at the last step;
* the gains: attention carries half of the reducible loss, decaying as t^(-1/3), on ``attn_all``,
  its layer groups and its concentrating heads; the LM head 2%, decaying as t^-1.

Every value but the peaked flags carries multiplicative noise (1 + noise N(0, 1)).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from peakprobe import results, vocab
from peakprobe.checkpoints_index import PYTHIA_STEPS

N_OPTIONS, VOCAB_SIZE = 256, 32000


def pythia_steps(n: int | None) -> list[int]:
    """``n`` Pythia steps spread in log index (all 154 when ``n`` is None or larger)."""
    grid = list(PYTHIA_STEPS)
    if n is None or n >= len(grid):
        return grid
    idx = {int(i) for i in np.round(np.geomspace(1, len(grid), n)).astype(int) - 1}
    while len(idx) < n:  # rounding merged some picks: split the widest gap
        s = sorted(idx)
        width, start = max((b - a, a) for a, b in zip(s, s[1:], strict=False))
        idx.add(start + width // 2)
    return [grid[i] for i in sorted(idx)]


def _metrics(beta: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """One site's row means as functions of its logit std ``beta`` (T,)."""
    c0 = np.sqrt(2 * np.log(n))
    ratio = beta / c0
    entropy = np.log(n) * np.exp(-ratio * ratio) + 1e-3
    flag = 1.0 / (1.0 + np.exp(-(beta - c0) / (0.1 * c0)))  # a smooth row fraction
    return {vocab.LOGIT_STD: beta, vocab.LOGIT_MAX_MINUS_MEAN: beta * c0,
            vocab.LOGIT_TOP_GAP: beta / 4, vocab.LOGIT_MAX: 3 * beta * c0, vocab.PEAKED: flag,
            vocab.MAX_PROB: 1 / n + (1 - 1 / n) * (1 - np.exp(-ratio * ratio)),
            vocab.ENTROPY: entropy, vocab.ENTROPY_NORM: entropy / np.log(n),
            vocab.BETA_EFF: beta, vocab.PEAKED_ENTROPY: flag}


def _sites(n_layers: int, n_heads: int, t: np.ndarray) -> dict[tuple, dict[str, np.ndarray]]:
    """Every site's noise-free metrics over the steps ``t`` (T,)."""
    x = np.maximum(t, 1.0) / t.max()
    c0 = np.sqrt(2 * np.log(N_OPTIONS))
    shapes = (1.6 * c0 * x ** (1 / 3), 1.6 * c0 * ((100 * x) ** (-4 / 3) + 1) ** -0.25,
              0.5 * c0 * x ** (1 / 3))  # concentrating, saturated, diffuse
    reducible = 0.5 * x ** (-1 / 3)
    sites: dict[tuple, dict[str, np.ndarray]] = {}
    n_conc = sum(1 for h in range(n_heads) if h % 3 == 0) * n_layers
    for layer in range(n_layers):
        for head in range(n_heads):
            m = _metrics(shapes[head % 3], N_OPTIONS)
            m.update({name + vocab.XSINK_SUFFIX: m[name] for name in (
                vocab.ENTROPY, vocab.MAX_PROB, vocab.LOGIT_STD, vocab.PEAKED, vocab.BETA_EFF,
                vocab.PEAKED_ENTROPY)})
            m[vocab.FIRST_KEY_PROB] = m[vocab.MAX_PROB] / 10
            m[vocab.SENSITIVITY] = np.full_like(t, -0.05 if head % 3 == 0 else -0.002)
            share = 0.4 / n_conc if head % 3 == 0 else 0.001
            m[vocab.GAIN] = share * reducible[-1] * x ** (-1 / 3 if head % 3 == 0 else -1.0)
            sites[(vocab.ATTN, layer, head)] = m
        sites[(vocab.ATTN_LAYER, layer, -1)] = {vocab.GAIN: 0.5 / n_layers * reducible[-1] * x ** (-1 / 3)}
    sites[(vocab.ATTN_ALL, -1, -1)] = {vocab.GAIN: 0.5 * reducible[-1] * x ** (-1 / 3)}
    lm = _metrics(shapes[1] * np.sqrt(np.log(VOCAB_SIZE) / np.log(N_OPTIONS)), VOCAB_SIZE)
    lm[vocab.LOSS] = 2.0 + reducible
    lm[vocab.TARGET_PROB] = np.exp(-lm[vocab.LOSS])
    lm[vocab.TARGET_LOGIT_MINUS_MEAN] = 2 * lm[vocab.LOGIT_STD]
    lm[vocab.SENSITIVITY] = np.full_like(t, -0.01)
    lm[vocab.GAIN] = 0.02 * reducible[-1] / x
    sites[(vocab.LM_HEAD, -1, -1)] = lm
    for m in sites.values():
        if vocab.GAIN in m:
            m[vocab.LOG_BETA_OPT] = 0.1 * np.sqrt(m[vocab.GAIN])
            m[vocab.CURVATURE] = 4 * m[vocab.GAIN]
    return sites


def write_run(run_dir: str | Path, n_layers: int, n_heads: int, *, n_checkpoints: int | None = None,
              seed: int = 0, noise: float = 0.01, duplicates: dict[str, str] | None = None) -> Path:
    """Write the planted run into ``run_dir`` (``duplicates``: revision -> the revision whose
    weights, hence results, it repeats; flagged in integrity.json)."""
    run_dir = Path(run_dir)
    steps = pythia_steps(n_checkpoints)
    t = np.array(steps, dtype=float)
    rows = [(site, name, v) for site, m in _sites(n_layers, n_heads, t).items()
            for name, v in sorted(m.items())]
    values = np.array([v for _, _, v in rows])  # (R, T)
    exact = np.array([name.startswith(vocab.PEAKED) for _, name, _ in rows])
    eps = np.random.default_rng(seed).standard_normal(values.shape)
    values = values * (1 + np.where(exact, 0.0, noise)[:, None] * eps)
    revisions = [f"step{s}" for s in steps]
    column = {rev: revisions.index((duplicates or {}).get(rev, rev)) for rev in revisions}
    for step, rev in zip(steps, revisions, strict=True):
        results.write_checkpoint(run_dir, rev, pd.DataFrame({
            "model": "planted", "revision": rev, "step": np.int64(step),
            "tokens": np.int64(step * 2_097_152), "tau": float(step),
            "site_kind": [s[0] for s, _, _ in rows], "layer": [s[1] for s, _, _ in rows],
            "head": [s[2] for s, _, _ in rows], "metric": [n for _, n, _ in rows],
            "value": values[:, column[rev]], "n_rows": np.int64(4096)}))
    results.write_json(run_dir / results.MANIFEST, {
        "format": results.FORMAT, "model": "planted", "source": "planted", "family": None,
        "fit_start_step": None, "data": {"spec": "planted", "n_windows": 0, "window": 0},
        "checkpoints": [{"revision": r, "step": s, "tokens": s * 2_097_152, "tau": float(s),
                         "path": None} for r, s in zip(revisions, steps, strict=True)],
        "probe": {}, "attribution": {"windows": 4}, "versions": {}})
    if duplicates:
        results.write_integrity(run_dir, {
            "format": 1, "hash": "sha256", "rule": "planted", "checked": revisions, "unchecked": [],
            "flagged": {rev: {"step": steps[revisions.index(rev)], "duplicates": [orig],
                              "files": ["model.safetensors"], "whole": True}
                        for rev, orig in duplicates.items()}})
    return run_dir
