"""Training primitives of the solvable linear-attention toy: the update rules, the data, the runs.

The model and data are described in docs/linear_attention.md. This module owns

* ``lsa_step``: one SGD step on a fresh batch (the sparse gather form of the dense readout
  ``lsa_predict_dense``);
* ``fullbatch_step``: one gradient-descent step on a finite training set of D sequences. The
  gradient of (1/D) sum_j 0.5 (y_q - y_hat)^2 for the columns of feature k depends on the set
  only through A_k = sum_{j in k} g_q^2 m and B_k = sum_{j in k} g_q^2 m^2 (``draw_dataset``), so
  a step costs O(M^2) whatever D is; the tests check it against autograd on the dense readout;
* ``train_fresh``: SGD with fresh batches for ``seeds`` replicas, optionally for several context
  lengths at once (groups that share every random draw except m: common random numbers), with
  N drawn per sequence independently of the task, or with N tied to the task and the summed
  readout h = sum_i y_i x_i (= w N m e_k); it records the per-step batch loss and the modes
  s_k = <W_K e_k, W_Q e_k> at chosen steps (from which ``population_loss`` is exact);
* ``train_dataset``: full-batch GD on one finite training set per replica;
* ``log_bins`` / ``bin_curve``: the log-spaced step bins every curve is averaged over.

m = (1/N) sum_i g_i^2 is drawn directly as a Gamma(N/2, 2/N) variate: h = (1/N) sum_i y_i x_i
is w m e_k, so this is the same distribution as drawing the N context tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

__all__ = [
    "DatasetRun",
    "FreshRun",
    "bin_curve",
    "draw_dataset",
    "fullbatch_step",
    "init_weights",
    "log_bins",
    "lsa_predict_dense",
    "lsa_step",
    "modes_of",
    "train_dataset",
    "train_fresh",
]


def log_bins(steps: int, n_bins: int) -> np.ndarray:
    """Log-spaced integer bin edges over steps 1..steps-1 (step 0, the start, is left out)."""
    raw = np.round(np.logspace(0.0, math.log10(steps), n_bins + 1)).astype(np.int64)
    return np.unique(np.clip(raw, 1, steps))


def bin_curve(values: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values[..., step]`` and of the step index over each bin: (t (P,), v (..., P))."""
    steps = np.arange(values.shape[-1], dtype=np.float64)
    t = np.array([steps[a:b].mean() for a, b in zip(edges[:-1], edges[1:], strict=True)])
    v = np.stack([values[..., a:b].mean(axis=-1) for a, b in zip(edges[:-1], edges[1:], strict=True)],
                 axis=-1)
    return t, v


def lsa_predict_dense(w_k: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor,
                      x_q: torch.Tensor) -> torch.Tensor:
    """Reference linear self-attention readout <W_K h, W_Q x_q> on dense vectors.

    w_k, w_q (S, M, M); h, x_q (S, B, M) -> (S, B).
    """
    keys = torch.bmm(h, w_k.transpose(1, 2))  # (S, B, M)
    queries = torch.bmm(x_q, w_q.transpose(1, 2))  # (S, B, M)
    return (keys * queries).sum(-1)


def lsa_step(w_k: torch.Tensor, w_q: torch.Tensor, feat: torch.Tensor, h_val: torch.Tensor,
             q_val: torch.Tensor, y_q: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step, in place, on the batch-mean of 0.5 (y_q - y_hat)^2; returns the loss (S,).

    A token is ``value * e_feat``; ``feat`` (S, B) in [0, M) for visible features, -1 for
    features the model does not embed (prediction 0, no gradient). h_val, q_val, y_q: (S, B).
    """
    s, m, _ = w_k.shape
    batch = feat.shape[1]
    visible = feat >= 0  # (S, B)
    idx = feat.clamp(min=0)  # (S, B)
    cols = idx.unsqueeze(1).expand(s, m, batch)  # (S, M, B)
    k_col = w_k.gather(2, cols)  # (S, M, B) = W_K e_feat
    q_col = w_q.gather(2, cols)  # (S, M, B) = W_Q e_feat
    y_hat = h_val * q_val * (k_col * q_col).sum(1) * visible  # (S, B)
    err = y_q - y_hat  # (S, B)
    loss = 0.5 * (err * err).mean(1)  # (S,)
    # d loss / d W_K[:, j] = -sum_{b: feat_b = j} err_b h_b q_b W_Q[:, j] / B (and K <-> Q)
    coef = torch.zeros(s, m, dtype=w_k.dtype, device=w_k.device)  # (S, M)
    coef.scatter_add_(1, idx, -(err * h_val * q_val * visible) / batch)
    grad_k = w_q * coef.unsqueeze(1)  # (S, M, M)
    grad_q = w_k * coef.unsqueeze(1)
    w_k.sub_(lr * grad_k)
    w_q.sub_(lr * grad_q)
    return loss


def modes_of(w_k: torch.Tensor, w_q: torch.Tensor) -> np.ndarray:
    """The modes s_k = <W_K e_k, W_Q e_k>: (S, M, M) x 2 -> (S, M) float64."""
    return (w_k * w_q).sum(1).double().numpy()


def fullbatch_step(w_k: torch.Tensor, w_q: torch.Tensor, a_sum: torch.Tensor, b_sum: torch.Tensor,
                   c_sum: torch.Tensor, n_seq: int, lr: float) -> torch.Tensor:
    """One GD step, in place, on (1/D) sum_j 0.5 (y_q - y_hat)^2 over a training set of D = n_seq
    sequences given by its sufficient statistics; returns the training loss before the step (S,).

    For a sequence of feature k, err h q = g_q^2 m (1 - m s_k), so the set enters through
    a_sum = sum g_q^2 m and b_sum = sum g_q^2 m^2 per feature (S, M); c_sum (S,) = sum of g_q^2
    over all D sequences gives the loss 0.5 (c - 2 sum_k a_k s_k + sum_k b_k s_k^2) / D.
    """
    s = (w_k * w_q).sum(1)  # (S, M)
    loss = 0.5 * (c_sum - (2.0 * a_sum * s - b_sum * s * s).sum(1)) / n_seq  # (S,)
    coef = -(a_sum - b_sum * s) / n_seq  # (S, M) = d loss / d s_k
    grad_k = w_q * coef.unsqueeze(1)  # (S, M, M)
    grad_q = w_k * coef.unsqueeze(1)
    w_k.sub_(lr * grad_k)
    w_q.sub_(lr * grad_q)
    return loss


def init_weights(gen: torch.Generator, replicas: int, m: int, init_scale: float,
                 init: str) -> tuple[torch.Tensor, torch.Tensor]:
    """W_K, W_Q (replicas, M, M) with entries N(0, sigma0^2 / M); ``balanced``: W_Q = W_K."""
    scale = init_scale / math.sqrt(m)
    w_k = torch.randn(replicas, m, m, generator=gen) * scale
    w_q = w_k.clone() if init == "balanced" else torch.randn(replicas, m, m, generator=gen) * scale
    return w_k, w_q


def _draw_m(rng: np.random.Generator, context: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """m = chi^2_N / N as Gamma(N/2, 2/N); ``context`` broadcasts against ``shape``; N = inf -> 1."""
    n = np.broadcast_to(np.asarray(context, dtype=np.float64), shape)
    finite = np.isfinite(n)
    safe = np.where(finite, n, 1.0)
    return np.where(finite, rng.gamma(safe / 2.0, 2.0 / safe, size=shape), 1.0)


def _draw_context(rng: np.random.Generator, dist: tuple[np.ndarray, np.ndarray],
                  shape: tuple[int, ...]) -> np.ndarray:
    """N per sequence from the distribution (values, weights)."""
    values, weights = (np.asarray(x, dtype=np.float64) for x in dist)
    cdf = np.cumsum(weights / weights.sum())
    return values[np.minimum(np.searchsorted(cdf, rng.random(shape)), len(values) - 1)]


def _draw_readout(rng: np.random.Generator, task: np.ndarray, ctx: np.ndarray,
                  context_dist: tuple[np.ndarray, np.ndarray] | None,
                  task_context: np.ndarray | None) -> np.ndarray:
    """The context's readout |h| of every sequence, (G, seeds, B) for ``task`` (seeds, B): m for
    the mean readout (N per group ``ctx`` (G, 1, 1), or drawn per sequence from
    ``context_dist``), N_k m for the summed readout with N tied to the task."""
    shape = (1, *task.shape)
    if context_dist is not None:
        return _draw_m(rng, _draw_context(rng, context_dist, shape), shape)
    if task_context is not None:  # summed readout: h = w N m e_k
        n_task = task_context[task][None]  # (1, seeds, B)
        return n_task * _draw_m(rng, n_task, shape)
    return _draw_m(rng, ctx, (ctx.shape[0], *task.shape))


@dataclass
class FreshRun:
    """SGD on fresh batches: ``loss[r, t]`` the batch loss of replica r at step t (before the
    update), ``modes[i, r, k]`` the mode s_k of replica r at step ``eval_steps[i]``."""

    loss: np.ndarray  # (S, steps)
    eval_steps: np.ndarray  # (E,)
    modes: np.ndarray  # (E, S, M)
    wall_s: float


def train_fresh(
    model_size: int,
    probs: np.ndarray,
    *,
    steps: int,
    seeds: int,
    batch: int,
    lr: float,
    init_scale: float,
    init: str,
    contexts: Sequence[float] = (32,),
    context_dist: tuple[np.ndarray, np.ndarray] | None = None,
    task_context: np.ndarray | None = None,
    eval_steps: np.ndarray | None = None,
    seed: int = 0,
    progress: bool = False,
    desc: str = "linear attention",
) -> FreshRun:
    """Train len(contexts) x ``seeds`` replicas of the size-M model by SGD on fresh batches.

    Replica g * seeds + j has context length contexts[g]; the groups share the initial weights
    and every draw except m (common random numbers), so differences between groups are the
    effect of N alone. ``context_dist`` = (values, weights) instead draws N for every sequence
    (then ``contexts`` must hold one entry). ``task_context`` (K,) gives every sequence of task k
    the context length task_context[k] and the summed readout h = w N m e_k (one group too).
    ``eval_steps``: steps (0..steps) at which the modes
    are recorded, before the update of that step (``steps`` itself: after the last update).
    """
    m, groups = int(model_size), len(contexts)
    if (context_dist is not None or task_context is not None) and groups != 1:
        raise ValueError("context_dist and task_context draw N per sequence: give a single group")
    seq = np.random.SeedSequence([int(seed), m, 7919])
    rng = np.random.default_rng(seq)
    gen = torch.Generator().manual_seed(int(seq.generate_state(1)[0]))
    w_k, w_q = init_weights(gen, seeds, m, init_scale, init)
    w_k, w_q = w_k.repeat(groups, 1, 1), w_q.repeat(groups, 1, 1)  # (S, M, M), S = groups * seeds
    cdf = np.cumsum(probs)
    ctx = np.asarray(contexts, dtype=np.float64).reshape(groups, 1, 1)
    eval_steps = np.array([], dtype=np.int64) if eval_steps is None else np.asarray(eval_steps)
    eval_set = {int(x) for x in eval_steps}
    modes, losses = [], torch.empty(steps, groups * seeds)
    start = time.perf_counter()
    for step in tqdm(range(steps + 1), disable=not progress, desc=desc, mininterval=1.0):
        if step in eval_set:
            modes.append(modes_of(w_k, w_q))
        if step == steps:
            break
        task = np.minimum(np.searchsorted(cdf, rng.random((seeds, batch))), len(probs) - 1)
        sign = rng.integers(0, 2, (seeds, batch)) * 2.0 - 1.0
        g_q = rng.standard_normal((seeds, batch))
        m_val = _draw_readout(rng, task, ctx, context_dist, task_context)  # (G, seeds, B)
        feat = torch.from_numpy(np.where(task < m, task, -1)).repeat(groups, 1)  # (S, B)
        sign_t = torch.from_numpy(sign).float().repeat(groups, 1)
        g_t = torch.from_numpy(g_q).float().repeat(groups, 1)
        h_val = sign_t * torch.from_numpy(m_val.reshape(groups * seeds, batch)).float()  # (S, B)
        losses[step] = lsa_step(w_k, w_q, feat, h_val, g_t, sign_t * g_t, lr)
    wall = time.perf_counter() - start
    mode_arr = np.stack(modes) if modes else np.zeros((0, groups * seeds, m))
    return FreshRun(losses.T.double().numpy(), eval_steps, mode_arr, wall)


def draw_dataset(rng: np.random.Generator, n_seq: int, replicas: int, probs: np.ndarray,
                 model_size: int, context: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One training set of D = n_seq sequences per replica, as its sufficient statistics.

    Returns A, B (replicas, M) = per-feature sums of g_q^2 m and g_q^2 m^2, C (replicas,) = sum of
    g_q^2 over all sequences, and the per-feature counts n_k (replicas, M).
    """
    m = int(model_size)
    task = np.minimum(np.searchsorted(np.cumsum(probs), rng.random((replicas, n_seq))), len(probs) - 1)
    g2 = rng.standard_normal((replicas, n_seq)) ** 2
    m_val = _draw_m(rng, np.asarray(context), (replicas, n_seq))
    visible = task < m
    rows = np.repeat(np.arange(replicas), n_seq).reshape(replicas, n_seq)
    flat = (rows * m + np.minimum(task, m - 1))[visible]  # index into (replicas * M)
    size = replicas * m

    def per_feature(w: np.ndarray) -> np.ndarray:
        return np.bincount(flat, weights=w[visible], minlength=size).reshape(replicas, m)

    a_sum = per_feature(g2 * m_val)
    b_sum = per_feature(g2 * m_val * m_val)
    counts = per_feature(np.ones_like(g2))
    return a_sum, b_sum, g2.sum(axis=1), counts


@dataclass
class DatasetRun:
    """Full-batch GD on one training set per replica: ``train_loss[r, t]`` on the set at step t,
    ``modes[i, r, k]`` at step ``eval_steps[i]``."""

    train_loss: np.ndarray  # (S, steps)
    eval_steps: np.ndarray  # (E,)
    modes: np.ndarray  # (E, S, M)
    wall_s: float


def train_dataset(a_sum: np.ndarray, b_sum: np.ndarray, c_sum: np.ndarray, n_seq: int, *,
                  steps: int, lr: float, init_scale: float, init: str, eval_steps: np.ndarray,
                  seed: int = 0) -> DatasetRun:
    """Full-batch GD (one step = one epoch over the D sequences) for every replica's set."""
    replicas, m = a_sum.shape
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([int(seed), m, n_seq]).generate_state(1)[0]))
    w_k, w_q = init_weights(gen, replicas, m, init_scale, init)  # (S, M, M)
    a_t, b_t = torch.from_numpy(a_sum).float(), torch.from_numpy(b_sum).float()  # (S, M)
    c_t = torch.from_numpy(np.asarray(c_sum)).float()  # (S,)
    eval_steps = np.asarray(eval_steps)
    eval_set = {int(x) for x in eval_steps}
    losses, modes = torch.empty(steps, replicas), []
    start = time.perf_counter()
    for step in range(steps + 1):
        if step in eval_set:
            modes.append(modes_of(w_k, w_q))
        if step == steps:
            break
        losses[step] = fullbatch_step(w_k, w_q, a_t, b_t, c_t, n_seq, lr)
    return DatasetRun(losses.T.double().numpy(), eval_steps, np.stack(modes), time.perf_counter() - start)
