"""Tests of the peaked-softmax teacher-student toy (peakprobe.toy.peaked_softmax).

References: torch autograd for the written-out KL gradient; the closed form teacher logit std
1/T; synthetic curves with known exponents for the summary; the 1/3 law band [0.30, 0.37] of
docs/science.md for short real runs.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from peakprobe import vocab
from peakprobe.toy.peaked_softmax import (
    PeakedRun,
    ToyConfigError,
    format_peaked,
    kl_and_grad,
    peaked_window,
    rmsnorm,
    run_peaked_softmax,
    summarize_peaked,
)

BAND = (0.30, 0.37)


def test_rmsnorm_puts_every_row_on_the_sphere_of_radius_sqrt_d():
    x = torch.randn(64, 32, dtype=torch.float64) * 7.0
    u = rmsnorm(x)
    torch.testing.assert_close((u * u).sum(-1), torch.full((64,), 32.0, dtype=torch.float64))
    # direction unchanged
    torch.testing.assert_close(u / u.norm(dim=-1, keepdim=True), x / x.norm(dim=-1, keepdim=True))


def test_kl_and_grad_match_autograd_of_torch_kl_div():
    g = torch.Generator().manual_seed(3)
    n, d, b, temperature = 11, 5, 40, 0.2
    teacher = torch.randn(n, d, generator=g, dtype=torch.float64)
    student = torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_()
    u = rmsnorm(torch.randn(b, d, generator=g, dtype=torch.float64))
    ref = torch.nn.functional.kl_div(
        torch.log_softmax(u @ student.T, -1), torch.log_softmax(u @ teacher.T / temperature, -1),
        reduction="batchmean", log_target=True,
    )
    (ref_grad,) = torch.autograd.grad(ref, student)
    loss, grad = kl_and_grad(student.detach(), teacher, u, temperature)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)


def test_teacher_logit_std_is_one_over_temperature_and_student_starts_at_zero():
    run = run_peaked_softmax(optimizer="sgd", steps=10, lr=1.0, temperature=0.01, progress=False,
                             eval_size=4096)
    # every teacher logit is N(0, 1/T^2) because |u|^2 = d and W* ~ N(0, 1/d)
    assert run.teacher_logit_std == pytest.approx(100.0, rel=0.05)
    assert run.steps[0] == 1 and run.steps[-1] == 10
    # from W = 0 the first steps only grow the student; the KL starts near its W = 0 value
    # E[log n - H(teacher)] <= log 128 and decreases
    assert np.all(np.diff(run.w_norm) > 0)
    assert run.loss[0] < math.log(128) and np.all(np.diff(run.loss) < 0)


def _synthetic_run(t: np.ndarray, loss: np.ndarray, w_norm: np.ndarray, std: np.ndarray) -> PeakedRun:
    return PeakedRun(optimizer="sgd", config={"n": 128, "d": 32}, steps=t.astype(np.int64),
                     loss=loss, w_norm=w_norm, logit_std=std, teacher_logit_std=1000.0, wall_s=0.0)


def test_summary_recovers_known_exponents_inside_the_window_only():
    t = np.unique(np.round(np.geomspace(1, 1e5, 80))).astype(float)
    std = 0.5 * t ** (1 / 3)  # crosses 2 sqrt(2 ln 128) = 6.23 at t ~ 2e3, ends ~23
    loss = 2.0 / std
    w_norm = 11.0 * std
    # outside the window the curves follow other laws; the fit must not see them
    early = std < 2 * math.sqrt(2 * math.log(128))
    loss = np.where(early, 7.0 * t**-0.9, loss)
    w_norm = np.where(early, 0.1 * t, w_norm)
    run = _synthetic_run(t, loss, w_norm, std)
    mask = peaked_window(run)
    assert mask.sum() > 10 and not mask[early].any()
    s = summarize_peaked(run, n_boot=50)
    assert s["loss_alpha"] == pytest.approx(1 / 3, abs=1e-6)
    assert s["w_norm_alpha"] == pytest.approx(1 / 3, abs=1e-6)
    assert s["logit_std_alpha"] == pytest.approx(1 / 3, abs=1e-6)
    assert s["window"]["t_min"] == t[mask][0]
    assert all(s["in_band"].values())


def test_summary_refuses_a_run_that_never_reaches_the_peaked_phase():
    t = np.arange(1, 50, dtype=float)
    run = _synthetic_run(t, 1 / t, t * 0.01, t * 0.01)
    with pytest.raises(ToyConfigError, match="train longer"):
        summarize_peaked(run)


def test_bad_arguments_raise_one_line_value_errors():
    with pytest.raises(ValueError, match="unknown optimizer"):
        run_peaked_softmax(optimizer="lbfgs", steps=10, progress=False)
    with pytest.raises(ValueError, match="steps"):
        run_peaked_softmax(optimizer="sgd", steps=3, progress=False)


def test_sgd_shows_the_one_third_law():
    """Shortened authors' setting (d=32, n=128, batch 1024, peaked teacher T=1e-3, student from
    zero): a larger lr (30 instead of 10) reaches the peaked window within 8000 steps."""
    run = run_peaked_softmax(optimizer="sgd", steps=8000, lr=30.0, progress=False)
    s = summarize_peaked(run, n_boot=100)
    assert s["window"]["n_points"] >= 15
    assert s["window"]["t_max"] / s["window"]["t_min"] > 30  # 1.5 decades of power law
    for key in ("loss", "w_norm", "logit_std"):
        assert BAND[0] <= s[f"{key}_alpha"] <= BAND[1], (key, s[f"{key}_alpha"])
    assert s["final"]["logit_std"] > 2 * math.sqrt(2 * math.log(128))


def test_reproduce_peaked_writes_plot_and_summary_and_prints_the_verdicts(tmp_path, capsys):
    from peakprobe.cli import main

    assert main(["toy", "peaked", "--optimizer", "sgd", "--steps", "2500", "--out",
                 str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / vocab.TOY_FILE).read_text())
    assert printed.strip().splitlines()[:-1] == format_peaked(saved).splitlines()
    number = r"-?\d+\.\d{3}"
    for label in ("loss decay", "\\|\\|W\\|\\| growth", "logit std growth"):
        pattern = (rf"{label}\s+alpha {number} \[{number}, {number}\] \(90% CI\) -> "
                   r"(consistent|inconsistent|inconclusive) with 1/3 \(band \[0.25, 0.42\]\)")
        assert re.search(pattern, printed), printed
    run = saved["runs"]["sgd"]
    assert f"{run['w_norm_alpha']:.3f} [{run['w_norm_alpha_lo']:.3f}" in printed
    assert (tmp_path / "peaked_sgd.png").stat().st_size > 10_000
    assert len(saved["runs"]["sgd"]["curves"]["steps"]) == len(saved["runs"]["sgd"]["curves"]["loss"])


@pytest.mark.slow
def test_full_authors_setting_sgd_and_adam():
    """Default settings (lr 10 SGD, 30000 steps; Adam lr 3e-3): SGD in band, Adam grows faster."""
    sgd = summarize_peaked(run_peaked_softmax(optimizer="sgd", progress=False))
    adam = summarize_peaked(run_peaked_softmax(optimizer="adam", progress=False))
    for key in ("loss", "w_norm"):
        assert BAND[0] <= sgd[f"{key}_alpha"] <= BAND[1], (key, sgd[f"{key}_alpha"])
    assert adam["w_norm_alpha"] > sgd["w_norm_alpha"] + 0.05
