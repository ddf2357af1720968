"""The peaked-softmax teacher-student toy: a linear softmax head learning a peaked teacher.

This module owns the toy of Liu, Liu, Pehlevan & Gore (the 1/3 law, see docs/toys.md): inputs
x ~ N(0, I_d) go through an RMS norm, u = x / rms(x) (so |u|^2 = d exactly), and a linear head of
n classes. The teacher's logits are W* u / T with W* fixed, entries N(0, 1/d), so every teacher
logit is N(0, 1/T^2) and the teacher's logit std over the classes is about 1/T; a small T makes
the teacher peaked (T = 1e-3: std ~ 1000, far above the random-energy threshold sqrt(2 ln n) ~ 3.1).
The student's logits are W u (temperature 1, as in the authors' code), W starts at zero, and it
is trained on KL(teacher || student) with a fresh batch every step, by SGD or Adam.

The KL gradient is written out (``kl_and_grad``: d KL / d z = p_student - p_teacher), so a step
is three small matmuls and two softmaxes; the optimizer itself is torch's own SGD / Adam.

Public names: ``PeakedRun``, ``run_peaked_softmax``, ``summarize_peaked``, ``plot_peaked``,
``reproduce_peaked``, ``peaked_window``, ``kl_and_grad``, ``rmsnorm``, ``run_to_dict``,
``ToyConfigError``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from peakprobe import vocab
from peakprobe.fits.third import judge_third
from peakprobe.probes.gaussian_entropy import peaked_threshold
from peakprobe.results import write_json
from peakprobe.toy import ToyConfigError
from peakprobe.toy.plots import plot_peaked
from peakprobe.vocab import BAND

__all__ = [
    "DEFAULTS",
    "PeakedRun",
    "ToyConfigError",
    "reproduce_peaked",
    "format_peaked",
    "kl_and_grad",
    "peaked_window",
    "plot_peaked",
    "rmsnorm",
    "run_peaked_softmax",
    "run_to_dict",
    "summarize_peaked",
]

# Per-optimizer defaults. SGD: the teacher temperature and learning rate are the low-T / high-lr
# corner of the authors' scan (T in 1e-3..1, lr in 1e-2..10); Adam: the authors' lr 3e-3.
DEFAULTS = {
    "sgd": {"lr": 10.0, "steps": 30_000},
    "adam": {"lr": 3e-3, "steps": 30_000},
}
TEMPERATURE = 1e-3
# Fit window (see ``peaked_window``): student logit std between WINDOW_LOW * sqrt(2 ln n) and
# teacher logit std / WINDOW_HIGH.
WINDOW_LOW = 2.0
WINDOW_HIGH = 20.0
THIRD_BAND = (0.30, 0.37)


@dataclass
class PeakedRun:
    """One training run of the peaked-softmax toy, logged at log-spaced steps.

    ``loss`` is KL(teacher || student) on a fixed evaluation set of ``eval_size`` inputs drawn
    once; ``w_norm`` is ||W||_F; ``logit_std`` is the std of the student's logits over the n
    classes, averaged over the evaluation rows; ``teacher_logit_std`` the same for the teacher.
    """

    optimizer: str
    config: dict
    steps: np.ndarray  # (P,) int64, 1-based step after which the values were measured
    loss: np.ndarray  # (P,)
    w_norm: np.ndarray  # (P,)
    logit_std: np.ndarray  # (P,)
    teacher_logit_std: float
    wall_s: float
    extra: dict = field(default_factory=dict)


def rmsnorm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2)) over the last axis (no gain, no epsilon: |result|^2 = d)."""
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True))


def kl_and_grad(student: torch.Tensor, teacher: torch.Tensor, u: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-mean KL(teacher || student) and its gradient in W, written out.

    student, teacher (n, d); u (B, d) normalised inputs. The logits are z = u W^T (student) and
    u W*^T / T (teacher); d KL / d z = p_student - p_teacher, so d KL / d W = (p - p*)^T u / B.
    """
    t_logp = torch.log_softmax(u @ teacher.T / temperature, dim=-1)  # (B, n)
    s_logp = torch.log_softmax(u @ student.T, dim=-1)  # (B, n)
    t_p = t_logp.exp()
    loss = (t_p * (t_logp - s_logp)).sum(dim=-1).mean()
    grad = (s_logp.exp() - t_p).T @ u / u.shape[0]  # (n, d)
    return loss, grad


def _log_steps(steps: int, n_log: int) -> np.ndarray:
    raw = np.round(np.logspace(0, math.log10(steps), n_log)).astype(np.int64)
    return np.unique(np.clip(raw, 1, steps))


def _check(d: int, n: int, batch: int, steps: int, lr: float, temperature: float, eval_size: int) -> None:
    for name, value in (("d", d), ("n", n), ("batch", batch), ("steps", steps), ("eval_size", eval_size)):
        if int(value) < 1:
            raise ToyConfigError(f"{name} must be a positive integer, got {value}")
    if n < 2:
        raise ToyConfigError(f"n (number of classes) must be at least 2, got {n}")
    if steps < 10:
        raise ToyConfigError(f"steps must be at least 10 to see any growth law, got {steps}")
    if not lr > 0 or not temperature > 0:
        raise ToyConfigError(f"lr and temperature must be positive, got lr={lr}, temperature={temperature}")


def run_peaked_softmax(
    *,
    optimizer: str = "sgd",
    d: int = 32,
    n: int = 128,
    batch: int = 1024,
    steps: int | None = None,
    lr: float | None = None,
    temperature: float = TEMPERATURE,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    n_log: int = 60,
    eval_size: int = 8192,
    threads: int | None = 1,
) -> PeakedRun:
    """Train the student head from zero on KL(teacher || student) and log the growth curves.

    ``temperature`` is the teacher's (student logits are W u). ``steps`` / ``lr`` default to
    ``DEFAULTS[optimizer]``. ``threads`` caps torch's intra-op threads for the run (restored
    afterwards): the matmuls are tiny, and one thread is the fastest on a shared 2-core machine;
    ``None`` leaves torch's setting alone.
    """
    optimizer = optimizer.lower()
    if optimizer not in DEFAULTS:
        raise ToyConfigError(f"unknown optimizer {optimizer!r}: use one of {sorted(DEFAULTS)}")
    steps = int(DEFAULTS[optimizer]["steps"] if steps is None else steps)
    lr = float(DEFAULTS[optimizer]["lr"] if lr is None else lr)
    _check(d, n, batch, steps, lr, temperature, eval_size)
    config = dict(optimizer=optimizer, d=d, n=n, batch=batch, steps=steps, lr=lr,
                  temperature=temperature, seed=seed, eval_size=eval_size)

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        return _train(config, device=device, progress=progress, n_log=n_log)
    finally:
        torch.set_num_threads(old_threads)


def _train(config: dict, *, device: str, progress: bool, n_log: int) -> PeakedRun:
    d, n, batch, steps = config["d"], config["n"], config["batch"], config["steps"]
    temperature = config["temperature"]
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(int(config["seed"]))
    teacher = torch.randn(n, d, generator=gen, device=dev) / math.sqrt(d)  # (n, d)
    student = torch.zeros(n, d, device=dev)  # (n, d)
    opt_cls = torch.optim.SGD if config["optimizer"] == "sgd" else torch.optim.Adam
    opt = opt_cls([student], lr=config["lr"])

    u_eval = rmsnorm(torch.randn(config["eval_size"], d, generator=gen, device=dev))  # (E, d)
    t_logp_eval = torch.log_softmax(u_eval @ teacher.T / temperature, dim=-1)  # (E, n)
    t_p_eval = t_logp_eval.exp()
    teacher_std = float((u_eval @ teacher.T / temperature).std(dim=-1, unbiased=False).mean())

    log_at = set(_log_steps(steps, n_log).tolist())
    rows: list[tuple[int, float, float, float]] = []
    start = time.perf_counter()
    for step in tqdm(range(1, steps + 1), disable=not progress, desc=f"peaked {config['optimizer']}",
                     mininterval=1.0):
        u = rmsnorm(torch.randn(batch, d, generator=gen, device=dev))  # (B, d)
        _, student.grad = kl_and_grad(student, teacher, u, temperature)
        opt.step()
        if step in log_at:
            z = u_eval @ student.T  # (E, n)
            kl = (t_p_eval * (t_logp_eval - torch.log_softmax(z, dim=-1))).sum(dim=-1).mean()
            rows.append((step, float(kl), float(student.norm()),
                         float(z.std(dim=-1, unbiased=False).mean())))
    wall = time.perf_counter() - start
    arr = np.array(rows, dtype=np.float64)
    return PeakedRun(
        optimizer=config["optimizer"], config=config, steps=arr[:, 0].astype(np.int64),
        loss=arr[:, 1], w_norm=arr[:, 2], logit_std=arr[:, 3], teacher_logit_std=teacher_std,
        wall_s=wall,
    )


def peaked_window(run: PeakedRun) -> np.ndarray:
    """Boolean mask of the logged points inside the power-law window.

    Rule: the student is well inside the peaked (low-temperature) phase, logit std >=
    WINDOW_LOW * sqrt(2 ln n), where L ~ c / beta holds; and still far from the teacher, logit
    std <= teacher std / WINDOW_HIGH, where the finite-teacher correction to L (about -2c/beta*)
    stays under ~10%.
    """
    c0 = peaked_threshold(run.config["n"])
    lo = WINDOW_LOW * c0
    hi = run.teacher_logit_std / WINDOW_HIGH
    return (run.logit_std >= lo) & (run.logit_std <= hi)


def _growth_dict(prefix: str, fit) -> dict:
    return {f"{prefix}_alpha": float(fit.alpha), f"{prefix}_alpha_lo": float(fit.alpha_lo),
            f"{prefix}_alpha_hi": float(fit.alpha_hi), f"{prefix}_c": float(fit.c),
            f"{prefix}_r2": float(fit.r2)}


def summarize_peaked(run: PeakedRun, *, n_boot: int = 400, seed: int = 0) -> dict:
    """Fitted exponents over the power-law window (``peaked_window``), with 90% bootstrap CIs.

    loss: L = c t^-alpha (``peakprobe.fits.fit_power_law``; the KL floor is exactly 0 because the
    teacher is realizable), and for reference L = L0 + c t^-alpha with L0 free
    (``fit_loss_law``: ``loss_alpha_free_L0``, ``loss_L0``); ||W||_F and logit std: m = c t^alpha
    (``fit_power_law``). ``in_band`` says whether an exponent lies in [0.30, 0.37].
    """
    from peakprobe.fits import fit_loss_law, fit_power_law

    mask = peaked_window(run)
    if int(mask.sum()) < 5:
        c0 = peaked_threshold(run.config["n"])
        raise ToyConfigError(
            f"only {int(mask.sum())} logged points have student logit std in "
            f"[{WINDOW_LOW * c0:.2f}, {run.teacher_logit_std / WINDOW_HIGH:.2f}]: "
            "train longer or with a larger lr (or a smaller teacher temperature)"
        )
    t = run.steps[mask].astype(np.float64)
    loss_fit = fit_power_law(t, run.loss[mask], n_boot=n_boot, ci=0.9, seed=seed)
    free_fit = fit_loss_law(t, run.loss[mask], n_boot=n_boot, ci=0.9, seed=seed)
    w_fit = fit_power_law(t, run.w_norm[mask], n_boot=n_boot, ci=0.9, seed=seed)
    s_fit = fit_power_law(t, run.logit_std[mask], n_boot=n_boot, ci=0.9, seed=seed)
    summary = {
        "optimizer": run.optimizer,
        "config": dict(run.config),
        "teacher_logit_std": float(run.teacher_logit_std),
        "peaked_threshold": peaked_threshold(run.config["n"]),
        "window": {"t_min": float(t[0]), "t_max": float(t[-1]), "n_points": int(mask.sum()),
                   "rule": f"{WINDOW_LOW:g} sqrt(2 ln n) <= logit_std <= teacher_logit_std / {WINDOW_HIGH:g}"},
        # the decay exponent is minus the fitted slope; its CI bounds swap accordingly
        "loss_alpha": -float(loss_fit.alpha), "loss_alpha_lo": -float(loss_fit.alpha_hi),
        "loss_alpha_hi": -float(loss_fit.alpha_lo), "loss_c": float(loss_fit.c),
        "loss_r2": float(loss_fit.r2),
        "loss_alpha_free_L0": float(free_fit.alpha), "loss_alpha_free_L0_lo": float(free_fit.alpha_lo),
        "loss_alpha_free_L0_hi": float(free_fit.alpha_hi), "loss_L0": float(free_fit.L0),
        **_growth_dict("w_norm", w_fit),
        **_growth_dict(vocab.LOGIT_STD, s_fit),
        "final": {"step": int(run.steps[-1]), "loss": float(run.loss[-1]),
                  "w_norm": float(run.w_norm[-1]), vocab.LOGIT_STD: float(run.logit_std[-1])},
        "wall_s": float(run.wall_s),
    }
    lo, hi = THIRD_BAND
    summary["in_band"] = {key: bool(lo <= summary[f"{key}_alpha"] <= hi)
                          for key in ("loss", "w_norm", vocab.LOGIT_STD)}
    summary["verdict_band"] = list(BAND)
    summary["verdict"] = {key: judge_third(summary[f"{key}_alpha_lo"], summary[f"{key}_alpha_hi"])
                          for key in ("loss", "w_norm", vocab.LOGIT_STD)}
    return summary


def format_peaked(summary: dict) -> str:
    """What ``peakprobe toy peaked`` prints: per optimizer, each exponent with its 90% interval,
    its three-way verdict against 1/3 (band stated) and the fitted window."""
    lines = []
    for name, run in summary["runs"].items():
        w = run["window"]
        band = run["verdict_band"]
        lines.append(f"peaked softmax, {name}: window steps {w['t_min']:.0f}-{w['t_max']:.0f} "
                     f"({w['n_points']} points; {w['rule']})")
        for key, label in (("loss", "loss decay"), ("w_norm", "||W|| growth"),
                           (vocab.LOGIT_STD, "logit std growth")):
            lines.append(
                f"  {label:<17} alpha {run[key + '_alpha']:.3f} "
                f"[{run[key + '_alpha_lo']:.3f}, {run[key + '_alpha_hi']:.3f}] (90% CI) -> "
                f"{run['verdict'][key]} with 1/3 (band [{band[0]:g}, {band[1]:g}])"
            )
        lines.append(f"  loss with a free floor: alpha {run['loss_alpha_free_L0']:.3f} "
                     f"[{run['loss_alpha_free_L0_lo']:.3f}, {run['loss_alpha_free_L0_hi']:.3f}], "
                     f"L0 {run['loss_L0']:.3g}")
    return "\n".join(lines)


def run_to_dict(run: PeakedRun) -> dict:
    """The run's curves and config as plain JSON-able lists."""
    out = asdict(run)
    for key in ("steps", "loss", "w_norm", vocab.LOGIT_STD):
        out[key] = np.asarray(out[key]).tolist()
    return out


def reproduce_peaked(
    out_dir: Path,
    *,
    optimizer: str = "both",
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """``peakprobe toy peaked``: train, fit, plot; write plots + ``vocab.TOY_FILE`` into ``out_dir``."""
    names = ["sgd", "adam"] if optimizer.lower() == "both" else [optimizer.lower()]
    for name in names:
        if name not in DEFAULTS:
            raise ToyConfigError(f"unknown optimizer {optimizer!r}: use sgd, adam or both")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"toy": "peaked_softmax", "band": list(THIRD_BAND), "runs": {}, "plots": []}
    for name in names:
        run = run_peaked_softmax(optimizer=name, steps=steps, seed=seed, progress=progress)
        fit = summarize_peaked(run)
        paths = plot_peaked(run, fit, out_dir)
        fit["curves"] = {k: v for k, v in run_to_dict(run).items()
                         if k in ("steps", "loss", "w_norm", vocab.LOGIT_STD)}
        summary["runs"][name] = fit
        summary["plots"] += [p.name for p in paths]
    write_json(out_dir / vocab.TOY_FILE, summary)
    return summary
