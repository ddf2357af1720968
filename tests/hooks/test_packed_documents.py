"""Packed documents: several documents in one row are probed as if each ran alone.

References: the same documents run separately through the same probe (float64, 1e-9); the
eval windows' position ids written out by hand; flash attention's ``cu_seq_lens`` against the
separate runs through the statistics engine; a Trainer fed by ``DataCollatorWithFlattening``
whose run directory ``fit`` and ``report`` accept.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import VOCAB, tiny_model

from peakprobe import vocab
from peakprobe.config import ProbeConfig
from peakprobe.corpus import build_tokenizer
from peakprobe.data import load_eval_data
from peakprobe.hooks import attach
from peakprobe.hooks.engine import SiteStats
from peakprobe.hooks.interface import softmax_kwargs
from peakprobe.probes import MaskSpec

LENGTHS = (5, 9, 7)
BIN = {n: (hi - lo) / vocab.HIST_BINS for n, (lo, hi) in vocab.HIST_RANGE.items()}


def _documents(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, n), generator=g) for n in LENGTHS]


def _frame_dict(frame) -> dict:
    return {(r.site_kind, r.layer, r.head, r.metric): (r.value, r.n_rows) for r in frame.itertuples()}


def _assert_same(packed: dict, alone: dict) -> None:
    assert packed.keys() == alone.keys()
    for key, (value, n) in alone.items():
        got, got_n = packed[key]
        assert got_n == n, key
        metric = key[3]
        if math.isnan(value):
            assert math.isnan(got), key
        elif "_q" in metric:  # histogram quantiles: the same rows fall in the same bins
            name = metric.rsplit("_q", 1)[0]
            assert abs(got - value) <= BIN[name] + 1e-9, key
        else:
            assert got == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("arch", ["gpt_neox", "llama_gqa", "mistral_sliding"])
def test_three_packed_documents_give_the_statistics_of_three_separate_runs(arch):
    model = tiny_model(arch)
    docs = _documents()
    config = ProbeConfig(dtype="float64", chunk=4)
    with attach(model, config) as probe:
        for doc in docs:
            probe.run_batch(doc)
        alone = _frame_dict(probe.to_frame())
    ids = torch.cat(docs, dim=1)  # (1, 21)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1)
    with attach(model, config) as probe:
        probe.run_batch(ids, None, pos)
        packed = _frame_dict(probe.to_frame())
    _assert_same(packed, alone)
    # not trivial: without the position ids the documents see each other and the numbers move
    with attach(model, config) as probe:
        probe.run_batch(ids)
        crossed = _frame_dict(probe.to_frame())
    key = ("attn", 1, 0, vocab.ENTROPY)
    assert crossed[key][0] != pytest.approx(alone[key][0], rel=1e-6)


def test_cu_seq_lens_become_document_starts_and_match_separate_runs():
    """The flash-attention varlen kwargs (``cu_seq_lens_q``) of a one-row batch: the engine's
    statistics equal those of the documents' causal attention run one by one."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(LENGTHS), 8, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 2, sum(LENGTHS), 8, generator=g, dtype=torch.float64) * 2
    cu = torch.tensor([0, 5, 14, 21], dtype=torch.int32)

    class Module:
        is_causal = True

    kw = softmax_kwargs(Module(), q, k, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    assert kw["doc_start"].tolist() == [[0] * 5 + [5] * 9 + [14] * 7]
    packed, alone = SiteStats(ProbeConfig(dtype="float64")), SiteStats(ProbeConfig(dtype="float64"))
    packed.attention(0, q, k, None, row_valid=None, **kw)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone.attention(0, q[:, :, a:b], k[:, :, a:b], None, spec=MaskSpec(), scaling=8 ** -0.5)
    _assert_same(_frame_dict(packed.accumulator.to_frame()), _frame_dict(alone.accumulator.to_frame()))


def test_packed_docs_windows_restart_positions_at_each_document():
    tok = build_tokenizer()
    data = load_eval_data("embedded", tok, n_windows=3, window=40, layout="packed-docs")
    plain = load_eval_data("embedded", tok, n_windows=3, window=40, layout="packed")
    assert data.layout == "packed-docs" and torch.equal(data.input_ids, plain.input_ids)
    assert data.describe()["positions_hash"].startswith("sha256:")
    eos = tok.eos_token_id
    for row_ids, row_pos in zip(data.input_ids.tolist(), data.position_ids.tolist(), strict=True):
        expect, p = [], 0
        for t in row_ids:
            expect.append(p)
            p = 0 if t == eos else p + 1
        assert row_pos == expect and row_pos[0] == 0
    batch = next(data.batches(2))
    assert batch[1] is None and torch.equal(batch[2], data.position_ids[:2])


def test_a_trainer_with_data_collator_with_flattening_writes_a_run_fit_and_report_accept(tmp_path):
    """Training batches packed by ``DataCollatorWithFlattening`` (position ids restart, no mask),
    the callback probing packed-docs windows: the run directory holds the planned probes and
    ``peakprobe fit`` / ``report`` run on it."""
    from helpers.trainer_run import VOCAB as TVOCAB
    from helpers.trainer_run import tiny_neox
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from peakprobe import results
    from peakprobe.cli import main
    from peakprobe.data import EvalData, token_hash
    from peakprobe.integrations import PeakprobeCallback

    g = torch.Generator().manual_seed(5)
    docs = []
    for _ in range(160):  # documents of 6 to 20 tokens whose second half repeats the first
        half = torch.randint(1, TVOCAB, (int(torch.randint(3, 11, (1,), generator=g)),), generator=g)
        row = torch.cat([half, half]).tolist()
        docs.append({"input_ids": row, "labels": row})
    ids = torch.cat([torch.tensor(d["input_ids"]) for d in docs[:12]])[: 4 * 32].view(4, 32)
    lengths = [len(d["input_ids"]) for d in docs[:12]]
    pos = torch.cat([torch.arange(n) for n in lengths])[: 4 * 32].view(4, 32)
    pos = pos - pos.gather(1, torch.zeros(4, 1, dtype=torch.long))  # each window starts a document
    evald = EvalData(ids, torch.ones_like(ids), "packed-docs test", token_hash(ids), "packed-docs", pos)
    args = TrainingArguments(str(tmp_path / "trainer"), max_steps=40, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=4, logging_steps=10, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=tiny_neox(dropout=0.0), args=args, train_dataset=docs,
                      data_collator=DataCollatorWithFlattening())
    run = tmp_path / "run"
    trainer.add_callback(PeakprobeCallback(trainer, evald, run, n_points=10))
    trainer.train()
    frames = results.read_results(run)
    assert frames["step"].nunique() >= 8
    assert main(["fit", str(run), "--n-boot", "50", "-q"]) in (0, 1)
    assert results.read_json(run / results.FITS_JSON)["window"]["n_points"] >= 5
    assert main(["report", str(run), "-q"]) == 0
    assert (run / "report" / "report.html").exists()
