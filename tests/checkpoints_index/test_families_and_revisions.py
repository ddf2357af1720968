"""Tests of peakprobe.checkpoints_index against independent references.

References used: the Pythia revision list and token counts rebuilt from the published rule; a
numeric integral (scipy quad) of an independently written warmup + cosine learning-rate function;
hand-written tables of real and malformed revision names; brute-force nearest-target selection.
No test touches the network: hub calls are either blocked by HF_HUB_OFFLINE=1 or replaced.
"""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.integrate import quad

from peakprobe.checkpoints_index import (
    PYTHIA_SHAPES,
    Checkpoint,
    CheckpointIndexWarning,
    CheckpointSequence,
    DuplicateStepError,
    HubError,
    NoCheckpointsError,
    OfflineError,
    RevisionNameError,
    ScheduleError,
    SelectionError,
    TableSchedule,
    UnknownFamilyError,
    UnknownRevisionError,
    WarmupCosine,
    format_index,
    from_hub,
    from_local,
    load_schedule,
    parse_amber_revision,
    parse_olmo1_revision,
    parse_olmo2_revision,
    parse_step_folder,
    parse_trainer_folder,
    pythia,
    resolve,
    schedule_from_json,
    sequence_from_branches,
)

SIZES = ["14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b"]
LR_MAX = {"14m": 1e-3, "31m": 1e-3, "70m": 1e-3, "160m": 6e-4, "410m": 3e-4, "1b": 2.5e-4,
          "1.4b": 2e-4, "2.8b": 1.6e-4, "6.9b": 1.2e-4, "12b": 1.2e-4}  # fmt: skip


def ref_lr(s: float, lr_max: float, warmup: float, total: float, final: float) -> float:
    """Independent scalar learning rate: linear warmup, cosine to final*lr_max, flat after."""
    if s < warmup:
        return lr_max * s / warmup
    if s > total:
        return final * lr_max
    progress = (s - warmup) / (total - warmup)
    floor = final * lr_max
    return floor + (lr_max - floor) * (1 + math.cos(math.pi * progress)) / 2


def ref_tau(t: float, lr_max: float, warmup: float, total: float, final: float) -> float:
    """Numeric integral of ref_lr / lr_max from 0 to t."""
    breaks = [b for b in (warmup, total) if 0 < b < t]
    val, _ = quad(lambda s: ref_lr(s, lr_max, warmup, total, final) / lr_max, 0, t,
                  points=breaks or None, limit=500, epsabs=0, epsrel=1e-12)  # fmt: skip
    return val


# ---------------------------------------------------------------- Pythia


def expected_pythia_steps() -> list[int]:
    steps = [0]
    s = 1
    while s <= 512:
        steps.append(s)
        s *= 2
    steps += list(range(1000, 143001, 1000))
    return steps


@pytest.mark.parametrize("size", SIZES)
def test_pythia_revisions_steps_tokens(size):
    seq = pythia(size)
    steps = expected_pythia_steps()
    assert len(seq) == 154 == len(steps)
    assert [c.step for c in seq] == steps
    assert [c.revision for c in seq] == [f"step{s}" for s in steps]
    assert [c.tokens for c in seq] == [s * 1024 * 2048 for s in steps]
    assert seq.source == f"EleutherAI/pythia-{size}"
    assert seq.name == f"pythia-{size}"
    assert seq.family == "pythia"
    assert seq.schedule.lr_max == LR_MAX[size]
    assert all(c.path is None for c in seq)


def test_pythia_deduped_variants_and_shapes():
    for size in SIZES[2:]:
        seq = pythia(size, deduped=True)
        assert seq.source == f"EleutherAI/pythia-{size}-deduped"
        assert len(seq) == 154
    for size in ("14m", "31m"):
        with pytest.raises(UnknownFamilyError, match="deduped"):
            pythia(size, deduped=True)
    with pytest.raises(UnknownFamilyError, match="70m"):
        pythia("50m")
    assert {k: (v.n_layers, v.hidden_size, v.n_heads) for k, v in PYTHIA_SHAPES.items()} == {
        "14m": (6, 128, 4), "31m": (6, 256, 8), "70m": (6, 512, 8), "160m": (12, 768, 12),
        "410m": (24, 1024, 16), "1b": (16, 2048, 8), "1.4b": (24, 2048, 16),
        "2.8b": (32, 2560, 32), "6.9b": (32, 4096, 32), "12b": (36, 5120, 40),
    }  # fmt: skip
    assert PYTHIA_SHAPES["160m"].head_dim == 64


@pytest.mark.parametrize("size", ["70m", "1b", "12b"])
def test_pythia_tau_matches_numeric_integral(size):
    seq = pythia(size)
    args = (LR_MAX[size], 1430, 143000, 0.1)
    last = seq.by_step(143000)
    assert last.tau == pytest.approx(ref_tau(143000, *args), rel=1e-6)
    for step in (1, 64, 1000, 2000, 48000, 100000):
        assert seq.by_step(step).tau == pytest.approx(ref_tau(step, *args), rel=1e-6)


# ---------------------------------------------------------------- schedules


def test_warmup_cosine_lr_and_tau_against_reference():
    sched = WarmupCosine(lr_max=3e-4, warmup_steps=200, total_steps=5000, final_lr_ratio=0.05)
    args = (3e-4, 200, 5000, 0.05)
    grid = np.array([0, 1, 50, 199.5, 200, 201, 1234.5, 4999, 5000, 5001, 9000])
    assert np.allclose(sched.lr(grid), [ref_lr(s, *args) for s in grid], rtol=1e-12, atol=0)
    assert isinstance(sched.lr(10), float)
    for t in grid:
        assert sched.tau(float(t)) == pytest.approx(ref_tau(float(t), *args), rel=1e-9, abs=1e-12)
    # dtau/dt = lr / lr_max (central difference on the closed form)
    for t in (100.0, 2500.0, 7000.0):
        h = 1e-3
        deriv = (sched.tau(t + h) - sched.tau(t - h)) / (2 * h)
        assert deriv == pytest.approx(ref_lr(t, *args) / 3e-4, rel=1e-6)


def test_warmup_cosine_edge_cases():
    no_warm = WarmupCosine(1.0, 0, 100, final_lr_ratio=0.0)
    assert no_warm.lr(0) == pytest.approx(1.0)
    assert no_warm.tau(100) == pytest.approx(50.0)  # mean of (1+cos)/2 over a half period is 1/2
    warm_only = WarmupCosine(1.0, 100, 100, final_lr_ratio=0.5)
    assert warm_only.tau(100) == pytest.approx(50.0)
    assert warm_only.tau(300) == pytest.approx(150.0)
    for bad in (dict(lr_max=0, warmup_steps=1, total_steps=2), dict(lr_max=1, warmup_steps=3, total_steps=2),
                dict(lr_max=1, warmup_steps=1, total_steps=2, final_lr_ratio=1.5)):  # fmt: skip
        with pytest.raises(ScheduleError):
            WarmupCosine(**bad)
    with pytest.raises(ScheduleError):
        no_warm.tau(-1)


def test_table_schedule_tau_is_integral_of_interpolant():
    steps, lr = [10, 20, 50, 80], [1e-4, 4e-4, 2e-4, 0.0]
    sched = TableSchedule(steps, lr)
    assert sched.lr_max == 4e-4

    def f(s):  # independent: constant before the first point, linear between, constant after
        return np.interp(s, steps, lr) / 4e-4

    for t in (0, 5, 10, 15, 20, 33.3, 80, 120):
        ref, _ = quad(f, 0, t, points=[p for p in steps if 0 < p < t] or None, epsabs=1e-13)
        assert sched.tau(t) == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert np.allclose(sched.tau(np.array([5.0, 33.3])), [sched.tau(5.0), sched.tau(33.3)])
    assert sched.lr(15) == pytest.approx(2.5e-4)


def test_table_sampled_from_cosine_approximates_closed_form():
    cos = WarmupCosine(1e-3, 100, 1000, 0.1)
    grid = np.arange(0, 1001)
    table = TableSchedule(grid, cos.lr(grid))
    assert table.tau(1000) == pytest.approx(cos.tau(1000), rel=1e-5)


def test_schedule_from_json_roundtrip_and_errors():
    w = schedule_from_json(
        {"kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 100, "total_steps": 2000}
    )
    assert w == WarmupCosine(1e-3, 100, 2000, 0.1)
    assert schedule_from_json(w.to_json()) == w
    t = schedule_from_json({"kind": "table", "steps": [0, 1, 2], "lr": [0.0, 1e-4, 2e-4]})
    assert t.tau(2) == pytest.approx((0.5e-4 + 1.5e-4) / 2e-4)
    assert schedule_from_json(t.to_json()) == t
    bad = [
        {"lr_max": 1},
        {"kind": "step"},
        {"kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 1},
        {"kind": "warmup_cosine", "lr_max": "big", "warmup_steps": 1, "total_steps": 9},
        {"kind": "table", "steps": [0, 1], "lr": [1.0]},
        {"kind": "table", "steps": [1, 0], "lr": [1.0, 1.0]},
        {"kind": "table", "steps": [0, 1], "lr": [0.0, 0.0]},
    ]
    for obj in bad:
        with pytest.raises(ScheduleError) as info:
            schedule_from_json(obj)
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- revision-name parsers


@pytest.mark.parametrize(
    "name, expected",
    [
        ("step1000-tokens4B", (1000, 4_000_000_000)),
        ("step0-tokens0B", (0, 0)),
        ("step556000-tokens2460B", (556000, 2_460_000_000_000)),
        ("step20-tokens84M", (20, 84_000_000)),
        ("step5-tokens2.5B", (5, 2_500_000_000)),
    ],
)
def test_parse_olmo1(name, expected):
    assert parse_olmo1_revision(name) == expected


@pytest.mark.parametrize(
    "name, step, tokens, stage, ingredient",
    [
        ("stage1-step1000-tokens5B", 1000, 5_000_000_000, 1, None),
        ("step1000-tokens5B", 1000, 5_000_000_000, 1, None),
        ("stage1-step140000-tokens588B", 140000, 588_000_000_000, 1, None),
        ("stage2-ingredient1-step11931-tokens50B", 11931, 50_000_000_000, 2, 1),
        ("stage2-ingredient3-step23852-tokens100B", 23852, 100_000_000_000, 2, 3),
    ],
)
def test_parse_olmo2(name, step, tokens, stage, ingredient):
    rev = parse_olmo2_revision(name)
    assert (rev.step, rev.tokens, rev.stage, rev.ingredient) == (step, tokens, stage, ingredient)
    assert rev[:2] == (step, tokens)


@pytest.mark.parametrize(
    "parser, name",
    [
        (parse_olmo1_revision, "step1000"),
        (parse_olmo1_revision, "step1000-tokens4"),
        (parse_olmo1_revision, "step1000-tokens4X"),
        (parse_olmo1_revision, "stage1-step1000-tokens4B"),
        (parse_olmo1_revision, "stepX-tokens4B"),
        (parse_olmo1_revision, " step1000-tokens4B"),
        (parse_olmo1_revision, ""),
        (parse_olmo2_revision, "main"),
        (parse_olmo2_revision, "stage-step1000-tokens5B"),
        (parse_olmo2_revision, "stage1-step1000"),
        (parse_olmo2_revision, "stage1-step1000-tokens5B-extra"),
        (parse_olmo2_revision, "ingredient1-stage2-step5-tokens1B"),
        (parse_amber_revision, "ckpt_1"),
        (parse_amber_revision, "ckpt_0000"),
        (parse_amber_revision, "ckpt_360"),
        (parse_amber_revision, "ckpt-001"),
        (parse_amber_revision, "main"),
        (parse_trainer_folder, "checkpoint_500"),
        (parse_trainer_folder, "checkpoint-"),
        (parse_trainer_folder, "step500"),
        (parse_step_folder, "step"),
        (parse_step_folder, "step-100"),
        (parse_step_folder, "steps100"),
        (parse_step_folder, "run_step100"),
        (parse_step_folder, "checkpoint-100"),
    ],
)
def test_malformed_names_raise_one_line_error(parser, name):
    with pytest.raises(RevisionNameError) as info:
        parser(name)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and repr(name) in str(info.value)


@pytest.mark.parametrize(
    "parser, name, expected",
    [
        (parse_amber_revision, "ckpt_000", 0),
        (parse_amber_revision, "ckpt_042", 42),
        (parse_amber_revision, "ckpt_358", 358),
        (parse_amber_revision, "ckpt_359", 359),
        (parse_trainer_folder, "checkpoint-500", 500),
        (parse_trainer_folder, "checkpoint-0", 0),
        (parse_step_folder, "step1000", 1000),
        (parse_step_folder, "run-step1000", 1000),
        (parse_step_folder, "my-run-v2-step7", 7),
    ],
)
def test_parse_indices(parser, name, expected):
    assert parser(name) == expected


# ---------------------------------------------------------------- local folders


def make_ckpt(root, name, config=True):
    d = root / name
    d.mkdir()
    if config:
        (d / "config.json").write_text("{}")
    return d


def test_from_local_discovers_sorts_and_warns(tmp_path):
    for name in ("step300", "checkpoint-20", "run-step1000", "step5"):
        make_ckpt(tmp_path, name)
    make_ckpt(tmp_path, "step77", config=False)
    make_ckpt(tmp_path, "logs")
    make_ckpt(tmp_path, ".cache")
    (tmp_path / "step9").write_text("a file, not a folder")
    with pytest.warns(CheckpointIndexWarning) as record:
        seq = from_local(tmp_path)
    text = " ".join(str(w.message) for w in record)
    assert "logs" in text and "step77" in text and ".cache" not in text
    assert seq.steps == [5, 20, 300, 1000]
    assert seq.revisions == ["step5", "checkpoint-20", "step300", "run-step1000"]
    assert [c.path for c in seq] == [str((tmp_path / r).resolve()) for r in seq.revisions]
    assert all(c.tau is None and c.tokens is None for c in seq)
    assert seq.schedule is None and seq.source == str(tmp_path.resolve())


def test_from_local_tau_from_schedule_json(tmp_path):
    for s in (0, 50, 100, 400, 2000):
        make_ckpt(tmp_path, f"step{s}")
    spec = {"kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 100, "total_steps": 2000}
    (tmp_path / "schedule.json").write_text(json.dumps(spec))
    seq = from_local(tmp_path)
    for c in seq:
        assert c.tau == pytest.approx(ref_tau(c.step, 1e-3, 100, 2000, 0.1), rel=1e-9, abs=1e-12)


def test_from_local_tau_from_trainer_state(tmp_path):
    for s in (10, 20, 30):
        make_ckpt(tmp_path, f"checkpoint-{s}")
    log = [
        {"step": s, "learning_rate": lr, "loss": 1.0}
        for s, lr in ((10, 2e-4), (20, 1e-4), (30, 0.0))
    ]
    log.append({"step": 30, "train_runtime": 1.0})  # entries without learning_rate are ignored
    (tmp_path / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    (tmp_path / "checkpoint-20" / "trainer_state.json").write_text(
        json.dumps({"log_history": log[:2]})
    )
    seq = from_local(tmp_path)  # uses the latest checkpoint's trainer state
    # constant 2e-4 from 0 to 10, then trapezoids, divided by lr_max = 2e-4
    assert [c.tau for c in seq] == pytest.approx([10.0, 10.0 + 7.5, 10.0 + 7.5 + 2.5])
    (tmp_path / "trainer_state.json").write_text(
        json.dumps({"log_history": [{"step": 1, "loss": 2}]})
    )
    with pytest.warns(CheckpointIndexWarning, match="no learning rates"):
        assert load_schedule(tmp_path) is None


def test_from_local_errors(tmp_path):
    with pytest.raises(NoCheckpointsError, match="no checkpoints"):
        from_local(tmp_path)
    with pytest.raises(NoCheckpointsError, match="not a folder"):
        from_local(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NoCheckpointsError, match="single checkpoint"):
        from_local(tmp_path)
    make_ckpt(tmp_path, "step100")
    make_ckpt(tmp_path, "checkpoint-100")
    with pytest.raises(DuplicateStepError, match="step 100"):
        from_local(tmp_path)
    (tmp_path / "schedule.json").write_text("{not json")
    with pytest.raises(ScheduleError, match="schedule.json"):
        from_local(tmp_path)


# ---------------------------------------------------------------- selection


def brute_force_select(steps, n, spacing):
    f = (lambda s: math.log(1 + s)) if spacing == "log" else float
    a, b = f(steps[0]), f(steps[-1])
    picked = {0, len(steps) - 1}
    for k in range(n):
        target = a + (b - a) * k / (n - 1)
        best = min(range(len(steps)), key=lambda i: (abs(f(steps[i]) - target), i))
        picked.add(best)
    return [steps[i] for i in sorted(picked)]


@pytest.mark.parametrize("n", [2, 5, 16, 40])
@pytest.mark.parametrize("spacing", ["log", "linear"])
def test_select_matches_brute_force(n, spacing):
    seq = pythia("70m")
    got = seq.select(n=n, spacing=spacing)
    assert got.steps == brute_force_select(seq.steps, n, spacing)
    assert got.steps[0] == 0 and got.steps[-1] == 143000
    assert got.steps == sorted(set(got.steps)) and len(got) <= n
    assert got.schedule == seq.schedule and got.name == seq.name


def test_select_exact_on_evenly_spaced_axes():
    log_seq = CheckpointSequence("x", "x", [Checkpoint(f"step{2**k - 1}", 2**k - 1, None, None) for k in range(21)],
                                 None, None)  # fmt: skip
    assert log_seq.select(n=11, spacing="log").steps == [2**k - 1 for k in range(0, 21, 2)]
    lin_seq = CheckpointSequence(
        "y", "y", [Checkpoint(f"s{i}", i, None, None) for i in range(101)], None, None
    )
    assert lin_seq.select(n=11, spacing="linear").steps == list(range(0, 101, 10))
    assert len(lin_seq.select(n=500)) == 101


def test_select_steps_ranges_and_errors():
    seq = pythia("160m")
    assert seq.select(steps=[2000, 1, 2000]).steps == [1, 2000]
    assert seq.select(revisions=["step512", "step0"]).revisions == ["step0", "step512"]
    with pytest.raises(UnknownRevisionError) as info:
        seq.select(steps=[1500])
    msg = str(info.value)
    assert "step1000" in msg and "step2000" in msg and "\n" not in msg
    with pytest.raises(UnknownRevisionError, match="step143000"):
        seq.select(revisions=["step999999"])
    ranged = seq.select(step_range=(256, 5000))
    assert ranged.steps == [s for s in expected_pythia_steps() if 256 <= s <= 5000]
    sub = seq.select(step_range=(512, 143000), n=4, spacing="linear")
    assert sub.steps == brute_force_select([s for s in seq.steps if s >= 512], 4, "linear")
    for kwargs in (dict(n=1), dict(n=0), dict(spacing="cubic"), dict(step_range=(10, 5)),
                   dict(step_range=(200000, 300000)), dict(steps=[1], n=3), dict(steps=[1], revisions=["step1"])):  # fmt: skip
        with pytest.raises(SelectionError):
            seq.select(**kwargs)


# ---------------------------------------------------------------- output


def test_to_frame_and_records():
    seq = pythia("70m").select(steps=[0, 1000])
    df = seq.to_frame()
    assert list(df.columns) == ["revision", "step", "tokens", "tau", "path"]
    assert df["tokens"].tolist() == [0, 1000 * 2097152]
    assert df["tau"].iloc[1] == pytest.approx(ref_tau(1000, 1e-3, 1430, 143000, 0.1), rel=1e-9)
    local = CheckpointSequence(
        "l", "/x", [Checkpoint("step3", 3, None, None, "/x/step3")], None, None
    )
    ldf = local.to_frame()
    assert ldf["tokens"].isna().all() and ldf["tau"].isna().all()
    assert [c.to_dict() for c in local] == [
        {"revision": "step3", "step": 3, "tokens": None, "tau": None, "path": "/x/step3"}
    ]


def test_format_index_is_aligned_and_complete():
    seq = pythia("410m").select(n=8)
    lines = format_index(seq).splitlines()
    assert "pythia-410m" in lines[0] and "EleutherAI/pythia-410m" in lines[0]
    header, rule, rows = lines[1], lines[2], lines[3:]
    assert set(rule) == {"-", " "}
    assert header.split() == ["revision", "step", "tokens", "tau"] and len(rows) == len(seq)
    # right-aligned numeric columns end at the same character as their header
    for col in ("step", "tokens", "tau"):
        end = header.index(col) + len(col)
        assert all(row[end - 1] != " " and (len(row) == end or row[end] == " ") for row in rows)
    for row, c in zip(rows, seq, strict=True):
        rev, step, tokens, tau = row.split()
        assert (rev, int(step), int(tokens.replace(",", ""))) == (
            f"step{c.step}",
            c.step,
            c.step * 2097152,
        )
        assert float(tau) == pytest.approx(
            ref_tau(c.step, 3e-4, 1430, 143000, 0.1), rel=1e-5, abs=1e-12
        )
    local = CheckpointSequence(
        "l", "/x", [Checkpoint("step3", 3, None, None, "/x/step3")], None, None
    )
    text = format_index(local)
    assert text.splitlines()[1].split() == ["revision", "step", "tokens", "tau", "path"]
    assert text.splitlines()[3].split() == ["step3", "3", "-", "-", "/x/step3"]


# ---------------------------------------------------------------- hub (no network) and resolve


@pytest.fixture(autouse=True)
def empty_hf_cache(monkeypatch, tmp_path):
    """Every test here sees an empty HF cache, whatever the machine's own cache holds."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


@pytest.fixture
def no_network(monkeypatch):
    """Make any real hub listing fail loudly, so a test can prove no request was attempted."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(huggingface_hub, "list_repo_refs", refuse)


def fake_refs(monkeypatch, names):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    refs = SimpleNamespace(branches=[SimpleNamespace(name=n) for n in names])
    monkeypatch.setattr(huggingface_hub, "list_repo_refs", lambda repo_id, token=None: refs)


def test_offline_error_names_families_and_local_folder(monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for call in (lambda: from_hub("allenai/OLMo-2-1124-7B"), lambda: resolve("LLM360/Amber")):
        with pytest.raises(OfflineError) as info:
            call()
        msg = str(info.value)
        assert isinstance(info.value, ValueError) and "\n" not in msg
        assert "pythia-70m" in msg and "local folder" in msg and "HF_HUB_OFFLINE" in msg


def test_connection_error_becomes_offline_error(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(*args, **kwargs):
        try:
            raise OSError("Name or service not known")
        except OSError as exc:
            raise ConnectionError("could not connect") from exc

    monkeypatch.setattr(huggingface_hub, "list_repo_refs", unreachable)
    with pytest.raises(OfflineError, match="unreachable"):
        from_hub("allenai/OLMo-1B-hf")


def test_resolve_builtin_and_unknown(monkeypatch, no_network, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("pythia-70m").source == "EleutherAI/pythia-70m"
    assert resolve("pythia-70m-deduped").name == "pythia-70m-deduped"
    assert len(resolve("EleutherAI/pythia-160m")) == 154
    for bad in ("gpt2", "olmo", "pythia-50m", "pythia-14m-deduped", ""):
        with pytest.raises(UnknownFamilyError) as info:
            resolve(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(UnknownFamilyError, match="pythia-<size>"):
        resolve("gpt2")
    with pytest.raises(NoCheckpointsError, match="does not exist"):
        resolve("./no/such/run")
    make_ckpt(tmp_path, "step4")
    assert resolve(str(tmp_path)).steps == [4]


def test_hub_listing_recognises_families(monkeypatch):
    fake_refs(monkeypatch, ["main"] + [f"step{s}" for s in (0, 1, 2, 1000, 143000)])
    seq = from_hub("EleutherAI/pythia-410m")
    assert seq.family == "pythia" and seq.steps == [0, 1, 2, 1000, 143000]
    assert seq.by_step(143000).tau == pytest.approx(
        ref_tau(143000, 3e-4, 1430, 143000, 0.1), rel=1e-6
    )

    fake_refs(monkeypatch, ["main", "step1000-tokens4B", "step0-tokens0B", "step2000-tokens8B"])
    seq = from_hub("allenai/OLMo-1B-hf")
    assert seq.family == "olmo1" and [(c.step, c.tokens) for c in seq] == [
        (0, 0),
        (1000, 4 * 10**9),
        (2000, 8 * 10**9),
    ]

    olmo2 = ["main", "stage1-step1000-tokens5B", "stage1-step140000-tokens588B", "step500-tokens3B",
             "stage2-ingredient1-step11931-tokens50B", "stage2-ingredient1-step5000-tokens21B"]  # fmt: skip
    fake_refs(monkeypatch, olmo2)
    with pytest.warns(CheckpointIndexWarning, match="stage2-ingredient1"):
        seq = from_hub("allenai/OLMo-2-1124-7B")
    assert seq.family == "olmo2" and seq.steps == [500, 1000, 140000]
    assert seq.by_step(140000).tokens == 588 * 10**9
    with pytest.warns(CheckpointIndexWarning, match="pass stage="):
        seq2 = from_hub("allenai/OLMo-2-1124-7B", stage="stage2-ingredient1")
    assert seq2.steps == [5000, 11931]
    with pytest.raises(HubError, match="stage3"):
        from_hub("allenai/OLMo-2-1124-7B", stage="stage3")

    fake_refs(monkeypatch, ["main", "ckpt_000", "ckpt_001", "ckpt_358"])
    seq = from_hub("LLM360/Amber")
    assert seq.family == "amber" and seq.steps == [0, 1, 358, 359]
    assert seq.revisions[-1] == "main"
    # published schedule: ckpt_k is saved after k + 1 data chunks
    assert [c.tokens for c in seq] == [(k + 1) * 1_706_976 * 2048 for k in (0, 1, 358, 359)]
    assert all(c.tau is not None and c.tau > 0 for c in seq)
    assert seq2.schedule is None and all(c.tau is None for c in seq2)  # stage 2: not published

    fake_refs(monkeypatch, ["main", "dev"])
    with pytest.raises(HubError, match="no checkpoint branches"):
        from_hub("someone/model")


def test_sequence_from_branches_majority_scheme_wins():
    names = [f"ckpt_{i:03d}" for i in range(5)] + ["step3", "main"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq = sequence_from_branches("LLM360/Amber", names)
    assert seq.family == "amber" and seq.steps == [0, 1, 2, 3, 4, 359]
    assert any("step3" in str(w.message) for w in caught)
