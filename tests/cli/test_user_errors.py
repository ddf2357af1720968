"""Rough edges a new user hit, each pinned by a test that runs the case as the user did.

1. a fit that lacks points in its window is skipped and said, the other fits and the report
   still run, and ``run`` exits 1 (work done, part failed);
2. a schedule JSON as training scripts write it (extra keys) is read, one warning names the
   ignored keys;
3. a checkpoint that is not a causal LM, or whose embedding table the tokenizer overruns, is
   refused before any forward pass, in one line; exit 2 when every checkpoint has the problem;
4. data errors name the file and the line;
5. a count printed beside names agrees with them;
6. ``--backend auto`` is the torch path on CPU;
and the error classes: bad input exits 2, a bug inside peakprobe exits 1 and says so.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from filelock import FileLock
from helpers import write_sequence
from transformers import BertConfig, BertModel, GPTNeoXConfig, GPTNeoXForCausalLM

from peakprobe import results, vocab
from peakprobe.checkpoints_index import CheckpointIndexWarning, schedule_from_json
from peakprobe.cli import main
from peakprobe.corpus import build_tokenizer
from peakprobe.data import DataError, load_eval_data

FAST = ["--n-windows", "4", "--window", "24", "--batch-size", "2", "--no-attribution", "-q"]


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("seq")
    write_sequence(folder)
    (folder / "eval.txt").write_text("\n\n".join(f"word{i} " * 30 for i in range(8)))
    return folder


def test_a_fit_short_of_points_is_skipped_and_the_report_still_written(sequence, tmp_path, capsys):
    out = tmp_path / "run"
    # steps 8, 16, 32, 64 in the window: growth fits (4 points) run, the loss law (5) cannot
    code = main(["run", str(sequence), "--out", str(out), "--data", str(sequence / "eval.txt"),
                 "--t-min-step", "8", *FAST])
    err = capsys.readouterr().err
    assert code == 1
    doc = results.read_json(out / results.FITS_JSON)
    (skip,) = doc["skipped"]
    assert (skip["fit"], skip["n_points"], skip["needed"]) == ("loss", 4, 5)
    assert "--t-min-step" in skip["reason"] and "skipped_loss" in doc["flags"]
    assert "loss fit skipped: 4 checkpoints in the window (steps 8-64)" in err
    fits = pd.read_parquet(out / results.FITS)
    assert (fits["fit"] == vocab.FIT_GROWTH).sum() > 0  # the other fits ran
    html = (out / "report" / "report.html").read_text()
    assert "The loss fit was skipped: 4 checkpoints in the window" in html
    # widened as the message says, every fit runs and the exit code is 0
    assert main(["fit", str(out), "--t-min-step", "1", "--n-boot", "50", "-q"]) == 0
    assert results.read_json(out / results.FITS_JSON)["skipped"] == []


def test_a_schedule_with_extra_keys_is_read_with_one_warning(tmp_path):
    lr = [0.0, 1e-3, 2e-3, 3e-3, 3e-3, 2e-3]
    plain = schedule_from_json({"lr": lr, "lr_max": 0.003})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        written = schedule_from_json({"lr": lr, "lr_max": 0.003, "saved_steps": [2, 4],
                                      "train_loss": {"2": 5.1, "4": 4.2}})
    said = [str(w.message) for w in seen if issubclass(w.category, CheckpointIndexWarning)]
    assert len(said) == 1 and "saved_steps, train_loss" in said[0]
    assert [written.tau(s) for s in range(6)] == [plain.tau(s) for s in range(6)]
    # a table with extra keys too, the same way
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table = schedule_from_json({"steps": [0, 5], "lr": [1.0, 1.0], "note": "x"})
    assert table.tau(5) == pytest.approx(5.0) and "note" in str(seen[0].message)


def _bert_folder(folder: Path) -> None:
    tok = build_tokenizer()
    cfg = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def test_an_encoder_only_checkpoint_is_refused_before_any_forward(tmp_path, capsys, monkeypatch):
    for step in (0, 4):
        _bert_folder(tmp_path / "seq" / f"step{step}")
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(f"word{i} " * 30 for i in range(8)))
    calls = []
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda *a, **k: calls.append(a) or pytest.fail("forward"))
    code = main(["sweep", str(tmp_path / "seq"), "--out", str(tmp_path / "run"), "--data", str(text),
                 *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not calls
    assert err[-1].startswith("peakprobe: error:") and "bert model (BertModel)" in err[-1]
    assert "not a causal language model" in err[-1]
    failures = results.read_failures(tmp_path / "run")  # recorded, nothing lost
    assert sorted(f["revision"] for f in failures) == ["step0", "step4"]


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, capsys):
    tok = build_tokenizer()
    small = GPTNeoXConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=64)
    for step in (0, 4):
        GPTNeoXForCausalLM(small).save_pretrained(tmp_path / "seq" / f"step{step}")
        tok.save_pretrained(tmp_path / "seq" / f"step{step}")
    code = main(["sweep", str(tmp_path / "seq"), "--out", str(tmp_path / "run"), "--data", "embedded",
                 *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "embedding table has 64 rows" in err[-1] and "--tokenizer" in err[-1]


def test_one_refused_checkpoint_among_good_ones_is_a_failure_not_bad_input(sequence, tmp_path, capsys):
    seq = tmp_path / "seq"
    for step in (0, 1, 2):
        src = sequence / f"step{step}"
        (seq / f"step{step}").mkdir(parents=True)
        for f in src.iterdir():
            (seq / f"step{step}" / f.name).write_bytes(f.read_bytes())
    _bert_folder(seq / "step3")
    code = main(["sweep", str(seq), "--out", str(tmp_path / "run"), "--data",
                 str(sequence / "eval.txt"), *FAST])
    assert code == 1
    assert "step3" in capsys.readouterr().err


def test_a_text_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    tok = build_tokenizer()
    bad = tmp_path / "eval.txt"
    bad.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(DataError, match=r"eval\.txt:2 is not UTF-8 text \(byte 0xff\)"):
        load_eval_data(str(bad), tok, n_windows=1, window=8)
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xfe"}\n')
    with pytest.raises(DataError, match=r"eval\.jsonl:3 is not UTF-8"):
        load_eval_data(str(jsonl), tok, n_windows=1, window=8)


def test_the_busy_count_agrees_with_the_names(sequence, tmp_path, capsys):
    """Another process holds six checkpoints: the line counts six and shows five and '1 more'."""
    out = tmp_path / "run"
    held = [FileLock(out / results.LOCKS / f"step{s}.lock", thread_local=False) for s in (1, 2, 4, 8, 16, 32)]
    (out / results.LOCKS).mkdir(parents=True)
    for lock in held:
        lock.acquire()
    try:
        code = main(["sweep", str(sequence), "--out", str(out), "--data", str(sequence / "eval.txt"),
                     "--n-windows", "4", "--window", "24", "--batch-size", "2", "--no-attribution"])
    finally:
        for lock in held:
            lock.release()
    err = capsys.readouterr().err
    assert code == 0
    line = next(x for x in err.splitlines() if "being probed by another process" in x)
    assert line.split("peakprobe: ")[-1].startswith("6 checkpoints")
    assert "(step1, step2, step4, step8, step16 and 1 more)" in line


def test_backend_auto_is_the_torch_path_on_cpu_and_compile_is_no_backend():
    from peakprobe.config import ConfigError, ProbeConfig
    from peakprobe.hooks.engine import resolve_backend

    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    with pytest.raises(ConfigError, match="backend must be one of auto, torch, triton"):
        ProbeConfig(backend="compile")


def test_an_internal_error_is_a_bug_not_bad_input(tmp_path, capsys, monkeypatch):
    from peakprobe import api

    def broken(*args, **kwargs):
        raise ValueError("an index went out of range inside peakprobe")

    monkeypatch.setattr(api, "fit", broken)
    assert main(["fit", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "internal error (a bug in peakprobe, not your input)" in err and "-v" in err
    assert "peakprobe: error:" not in err
    # the user's own mistake is still bad input: one line, exit 2
    monkeypatch.undo()
    assert main(["fit", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("peakprobe: error:")


def test_every_user_error_class_shares_one_base():
    import peakprobe.checkpoint
    import peakprobe.cli
    import peakprobe.integrations
    import peakprobe.reports
    import peakprobe.sweep
    import peakprobe.toy.planted  # noqa: F401

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    names = {c.__name__ for c in subclasses(vocab.PeakprobeError)}
    for name in ("ConfigError", "DataError", "CheckpointError", "CheckpointIndexError", "FitError",
                 "RunDirError", "ReportError", "SweepError", "UnsupportedModelError", "MonitorError"):
        assert name in names, name
    user_facing = [c for c in subclasses(ValueError) if c.__module__.startswith("peakprobe")]
    assert all(issubclass(c, vocab.PeakprobeError) for c in user_facing), user_facing


def test_cli_options_come_from_the_records():
    """One source of defaults, types and help: a bare command builds the records' defaults; the
    same option has the same type in every command; one --band parser."""
    from peakprobe.checkpoints_index import Selection
    from peakprobe.cli import build_parser
    from peakprobe.cli.commands import _curve_config, _fit_config, _sweep_kwargs
    from peakprobe.config import DataConfig, FitConfig, SweepConfig

    parser = build_parser()
    kwargs = _sweep_kwargs(parser.parse_args(["sweep", "some-run", "--out", "R"]), "cmd")
    assert kwargs["config"] == SweepConfig() and kwargs["data"] == DataConfig()
    assert kwargs["selection"] == Selection()
    assert _fit_config(parser.parse_args(["fit", "R"])) == FitConfig()
    fit = _fit_config(parser.parse_args(["fit", "R", "--t-min-step", "512", "--band", "0.3,0.36"]))
    curve = _curve_config(parser.parse_args(["fit-curve", "f.csv", "--t-min-step", "512",
                                             "--band", "0.3,0.36"]))
    assert fit.t_min_step == curve.t_min_step == 512 and isinstance(curve.t_min_step, int)
    assert fit.band == curve.band == (0.3, 0.36)
    with pytest.raises(SystemExit):
        parser.parse_args(["fit-curve", "f.csv", "--band", "0.4,0.5"])
    manifest_like = json.loads(json.dumps(SweepConfig().probe.describe()))
    assert "attribution_windows" not in manifest_like  # the probe record is about probing only
