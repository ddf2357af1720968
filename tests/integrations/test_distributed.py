"""Probing under torch.distributed: the accumulator merge (probes.merge) against a single
accumulator, and two gloo processes (torch.multiprocessing) probing DDP, FSDP2 and tensor
parallel models against a single-process run on the same windows."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
from helpers import dist_run

from peakprobe import vocab
from peakprobe.cli import main
from peakprobe.probes import Accumulator, SiteGroup
from peakprobe.probes.merge import (
    MAX,
    SUM,
    merge_row_parts,
    pack,
    pack_layers,
    reduce_accumulator,
    stack_sums,
    unpack,
    unpack_layers,
)
from peakprobe.probes.rows import block_sums, row_stats

KEYS = ["site_kind", "layer", "head", "metric"]


def _rows(seed: int, heads: int = 4, rows: int = 12, n: int = 9) -> tuple:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(heads, rows, n, generator=g, dtype=torch.float64) * 3  # (H, R, N)
    return z, row_stats(z, torch.ones(1, 1, n, dtype=torch.bool))


def _simulated(parts: list[Accumulator], **kw) -> list[Accumulator]:
    """Each 'rank' reduced through pack/unpack, the all-reduce done by hand over the ranks."""
    packed = [pack(a, kw.get("place") and (lambda g, h, r=r: kw["place"](g, h, r))) for r, a in enumerate(parts)]
    total = torch.stack([p[1] for p in packed]).sum(0)
    top = torch.stack([p[2] for p in packed]).amax(0)
    return [unpack(p[0], total, top)[0] for p in packed]


def test_merge_of_split_rows_equals_one_accumulator():
    """Rows split over two ranks merge (one SUM, one MAX) into the one accumulator's frame."""
    _, whole = _rows(0)
    one = Accumulator()
    one.add_rows(SiteGroup(vocab.ATTN, 0), whole, head_dim=0)
    parts = []
    for sl in (slice(0, 5), slice(5, 12)):
        a = Accumulator()
        stats = type(whole)({k: v[:, sl] for k, v in whole.values.items()},
                            {k: v.expand_as(whole.values[k])[:, sl] for k, v in whole.weight.items()})
        a.add_rows(SiteGroup(vocab.ATTN, 0), stats, head_dim=0)
        parts.append(a)
    merged = _simulated(parts)
    expect, got = one.to_frame(), merged[0].to_frame()
    pd.testing.assert_frame_equal(got, merged[1].to_frame())
    np.testing.assert_allclose(got["value"], expect["value"], rtol=1e-12)
    assert (got["n_rows"] == expect["n_rows"]).all()
    top = got["metric"] == vocab.LOGIT_MAX
    assert (got.loc[top, "value"].to_numpy() == expect.loc[top, "value"].to_numpy()).all()


def test_reduce_accumulator_two_ops_and_extra():
    _, stats = _rows(1)
    a = Accumulator()
    a.add_rows(SiteGroup(vocab.ATTN, 0), stats, head_dim=0)
    a.add_rows(SiteGroup(vocab.ATTN, 1), stats, head_dim=0)
    ops = []
    merged, extra = reduce_accumulator(a, lambda t, op: ops.append(op), extra=torch.tensor([0.0, 1.0]))
    assert ops == [SUM, MAX]  # one per reduce op, however many groups
    assert extra.tolist() == [0.0, 1.0]
    pd.testing.assert_frame_equal(merged.to_frame(), a.to_frame())


def test_local_heads_placed_at_global_indices():
    """Two tensor-parallel ranks with heads 0-1 and 2-3 merge into the 4-head accumulator."""
    _, whole = _rows(2)
    one = Accumulator()
    one.add_rows(SiteGroup(vocab.ATTN, 0), whole, head_dim=0)
    parts = []
    for lo in (0, 2):
        a = Accumulator()
        stats = type(whole)({k: v[lo : lo + 2] for k, v in whole.values.items()},
                            {k: v.expand_as(whole.values[k])[lo : lo + 2] for k, v in whole.weight.items()})
        a.add_rows(SiteGroup(vocab.ATTN, 0), stats, head_dim=0)
        parts.append(a)
    merged = _simulated(parts, place=lambda g, h, r: (2 * r, 4))
    pd.testing.assert_frame_equal(merged[0].to_frame(), one.to_frame())


def test_per_layer_tables_placed_and_summed():
    """Per-layer head tables (the geometry and role sums) of two tensor-parallel ranks land at
    their global heads; a rank placed nowhere adds zeros; what follows the tables comes back."""
    g = torch.Generator().manual_seed(5)
    whole = {0: torch.randn(4, 3, generator=g, dtype=torch.float64),
             1: torch.randn(4, 3, generator=g, dtype=torch.float64)}  # layer -> (H, W)
    packed = [pack_layers({k: t[2 * r : 2 * r + 2] for k, t in whole.items()},
                          lambda grp, h, r=r: (2 * r, 4)) for r in (0, 1)]
    total = packed[0][1] + packed[1][1]
    got, rest = unpack_layers(packed[0][0], torch.cat([total, torch.tensor([7.0])]))
    assert sorted(got) == [0, 1] and rest.tolist() == [7.0]
    for k in whole:
        assert torch.equal(got[k], whole[k])
    slots, flat = pack_layers({0: whole[0]}, lambda grp, h: None)
    assert slots == [(0, 4, 3)] and torch.equal(flat, torch.zeros(12, dtype=torch.float64))


def test_vocabulary_shards_merge_max_and_lse_exactly():
    """Per-row sums of two vocabulary shards merge to the whole row's (max and lse combined)."""
    z, _ = _rows(3, n=61)
    whole = block_sums(z)
    parts = [stack_sums(block_sums(z[..., :31])), stack_sums(block_sums(z[..., 31:]))]
    got = merge_row_parts(parts)
    assert torch.equal(got.m, whole.m)
    lse = lambda s: s.m + s.s.log()  # noqa: E731
    torch.testing.assert_close(lse(got), torch.logsumexp(z, -1), rtol=1e-14, atol=0)
    for f in ("n", "s", "a", "d1", "d2", "m2"):
        torch.testing.assert_close(getattr(got, f), getattr(whole, f), rtol=1e-12, atol=1e-12)


# -- two processes --------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(jobs: list[dict], out: Path) -> dict[str, list[dict]]:
    mp.spawn(dist_run.worker, args=(2, _port(), jobs, str(out)), nprocs=2, join=True)
    return {j["name"]: [json.loads((out / j["name"] / f"rank{r}.json").read_text()) for r in range(2)]
            for j in jobs}


def _frame(where: Path, step: int = 0) -> pd.DataFrame:
    df = pd.read_parquet(where / "run" / "checkpoints" / f"step{step}.parquet")
    return df.set_index(KEYS).sort_index()


def _rel(a: pd.Series, b: pd.Series) -> pd.Series:
    both_nan = a.isna() & b.isna()
    rel = (a - b).abs() / np.maximum(b.abs(), 1e-300)
    return rel.where(~both_nan, 0.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    """One spawn of two gloo processes for every layout; the single-process references here."""
    out = tmp_path_factory.mktemp("dist")
    jobs = [
        {"name": "ddp-neox", "mode": "ddp", "arch": "neox", "count": True},
        {"name": "ddp-llama", "mode": "ddp", "arch": "llama"},
        {"name": "fsdp-neox", "mode": "fsdp", "arch": "neox"},
        {"name": "fsdp-llama", "mode": "fsdp", "arch": "llama", "count": True},
        {"name": "tp-neox", "mode": "tp", "arch": "neox"},
        {"name": "tp-llama", "mode": "tp-vocab", "arch": "llama", "count": True},
        {"name": "tp64-neox", "mode": "tp-vocab", "arch": "neox", "dtype": "float64"},
        {"name": "tp64-llama", "mode": "tp", "arch": "llama", "dtype": "float64"},
        {"name": "fail", "mode": "fsdp", "arch": "llama", "fail_rank": 1, "count": True},
        {"name": "fail-first", "mode": "tp-vocab", "arch": "neox", "fail_rank": 0, "fail_first": True},
    ]
    got = _spawn(jobs, out)
    for arch in ("neox", "llama"):
        for dtype in ("float32", "float64"):
            dist_run.probe("single", arch, out / f"single-{arch}-{dtype}", dtype=dtype)
    return out, got


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_data_parallel_merge_equals_one_process(runs, mode, arch):
    """DDP and FSDP2: every window probed once over two ranks; the merged run equals one
    process on the same windows (1e-6 relative in float32, maxima and row counts exact)."""
    out, got = runs
    assert [g["layout"]["kind"] for g in got[f"{mode}-{arch}"]] == [("replicas" if mode == "ddp" else "fsdp2")] * 2
    assert got[f"{mode}-{arch}"][0]["done"] == [0] and got[f"{mode}-{arch}"][1]["done"] == []  # rank 0 writes
    a, b = _frame(out / f"{mode}-{arch}"), _frame(out / f"single-{arch}-float32")
    assert a.index.equals(b.index)
    assert (a["n_rows"] == b["n_rows"]).all()
    assert _rel(a["value"], b["value"]).max() <= 1e-6
    top = a.index.get_level_values("metric") == vocab.LOGIT_MAX
    assert (a.loc[top, "value"] == b.loc[top, "value"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_tensor_parallel_global_heads_and_lm_head(runs, arch):
    """Tensor parallel: each rank computes half the heads; the merged frame has the unsharded
    model's global head indices and equals it. In float64 every statistic to 1e-9 (maxima to
    1e-12: the sharded forward's matmuls round differently); in float32 the well-conditioned
    ones to 1e-6, the LM head's entropy and largest logit included."""
    out, got = runs
    assert got[f"tp-{arch}"][0]["layout"]["tensor_parallel"] == 2
    for name, dtype in ((f"tp64-{arch}", "float64"), (f"tp-{arch}", "float32")):
        a, b = _frame(out / name), _frame(out / f"single-{arch}-{dtype}")
        assert a.index.equals(b.index)
        heads = sorted(set(a.xs(vocab.ATTN, level="site_kind").index.get_level_values("head")))
        assert heads == [0, 1, 2, 3]
        assert (a["n_rows"] == b["n_rows"]).all()
        rel = _rel(a["value"], b["value"])
        if dtype == "float64":
            assert rel.max() <= 1e-9
            top = a.index.get_level_values("metric") == vocab.LOGIT_MAX
            assert rel[top].max() <= 1e-12
        else:
            metrics = a.index.get_level_values("metric")
            steady = metrics.isin([vocab.ENTROPY, vocab.MAX_PROB, vocab.LOGIT_STD, vocab.LOGIT_MAX, vocab.LOSS])
            assert rel[steady].max() <= 1e-6
        lm = rel.xs(vocab.LM_HEAD, level="site_kind")
        assert lm.xs(vocab.ENTROPY, level="metric").max() <= 1e-6
        assert lm.xs(vocab.LOGIT_MAX, level="metric").max() <= 1e-6


@pytest.mark.slow
def test_collectives_per_probe(runs):
    """One all-reduce per reduce op (SUM, MAX) per probe, whatever the layers and heads; a
    vocab-parallel LM head adds one all-gather per batch; nothing is gathered unless a rank fails."""
    _, got = runs
    for name in ("ddp-neox", "fsdp-llama"):
        for rank in got[name]:
            assert rank["counts"] == {"all_reduce": 2, "all_gather": 0, "all_gather_object": 0}
    n_batches = -(-dist_run.N_WINDOWS // dist_run.BATCH)
    for rank in got["tp-llama"]:
        assert rank["counts"] == {"all_reduce": 2, "all_gather": n_batches, "all_gather_object": 0}


@pytest.mark.slow
def test_failing_rank_is_said_on_rank_zero(runs):
    """FSDP2, rank 1's statistics raise at step 2: its forward goes on (FSDP's collectives all
    run), rank 0 records the rank and the error in one line, both ranks go on (2 all-reduces,
    then one gather of the messages)."""
    out, got = runs
    zero, one = got["fail"]
    assert zero["done"] == [0] and zero["failed"] == ["step2"] and one["failed"] == []
    assert zero["counts"] == one["counts"] == {"all_reduce": 4, "all_gather": 0, "all_gather_object": 1}
    lines = (out / "fail" / "run" / "failures.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert len(lines) == 1 and record["ranks"] == [1] and record["step"] == 2
    assert record["error"] == "rank 1 raised ValueError: planted failure in the statistics"
    assert not (out / "fail" / "run" / "checkpoints" / "step2.parquet").exists()
    # tensor parallel with a vocab-parallel LM head, rank 0 failing at the first probe (no earlier
    # layout): its LM head still joins the gathers, both probes are dropped, nothing hangs
    zero, one = got["fail-first"]
    assert zero["failed"] == ["step0", "step2"] and zero["done"] == [] and one["failed"] == []
    record = json.loads((out / "fail-first" / "run" / "failures.jsonl").read_text().splitlines()[0])
    assert record["ranks"] == [0] and record["step"] == 0


@pytest.mark.slow
def test_fsdp_training_with_monitor_unchanged_and_fitted(tmp_path):
    """Two-process FSDP2 training (dropout 0.1): the losses with the Monitor equal those
    without it exactly; `peakprobe fit` and `report` accept the run."""
    got = _spawn([{"name": "train", "train": True}], tmp_path)["train"]
    for rank in got:
        assert rank["with"] == rank["without"]
    run = tmp_path / "train" / "run"
    assert len(list((run / "checkpoints").glob("*.parquet"))) >= 6
    assert main(["fit", str(run)]) in (0, 1)  # 1: fits skipped for few points, still written
    assert (run / "fits.parquet").exists()
    assert main(["report", str(run)]) == 0
    assert (run / "report" / "report.html").exists()


@pytest.mark.slow
def test_trainer_callback_under_fsdp2(tmp_path):
    """The Trainer callback, sent the Trainer's events, on an FSDP2 model in two processes:
    every planned step written once (by rank 0), no failure; the gains it was asked for are
    skipped and the run says so."""
    got = _spawn([{"name": "cb", "callback": True}], tmp_path)["cb"]
    zero, one = got
    assert zero["layout"]["kind"] == one["layout"]["kind"] == "fsdp2"
    assert zero["done"] == zero["planned"] and one["done"] == [] and not zero["failed"]
    written = sorted(int(p.stem[4:]) for p in (tmp_path / "cb" / "run" / "checkpoints").glob("*.parquet"))
    assert written == zero["planned"]
    assert zero["attribution_steps"] == []
    record = json.loads((tmp_path / "cb" / "run" / "monitor.json").read_text())
    assert record["distributed"]["kind"] == "fsdp2" and "gains are skipped" in record["gains_skipped"]
    assert json.loads((tmp_path / "cb" / "run" / "manifest.json").read_text())["attribution"] is None


@pytest.mark.slow
def test_merge_waits_at_most_its_timeout(tmp_path):
    """A rank that never joins the probe (stuck, or dead): rank 0's merge raises
    DistributedProbeError after ``Monitor(timeout=2)`` seconds, naming itself, instead of hanging."""
    zero, one = _spawn([{"name": "stalled", "stalled": True}], tmp_path)["stalled"]
    assert one["error"] is None
    assert zero["error"].startswith("rank 0: the probe's merge waited 2 s for the other ranks")
    assert zero["seconds"] < 10  # before rank 1 (asleep 10 s) ever left
