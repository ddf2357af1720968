"""Evaluation windows: sources, exact token content, hash, errors, batching and padding."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from peakprobe import corpus
from peakprobe.data import (
    DataError,
    EvalData,
    load_eval_data,
    pad_batch,
    parse_hf_spec,
    token_hash,
)


@pytest.fixture(scope="module")
def tok():
    return corpus.build_tokenizer()


def _reference_stream(tok, docs: list[str]) -> list[int]:
    """Brute force: encode each document alone, append eos, concatenate."""
    out: list[int] = []
    for doc in docs:
        out += tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
    return out


def _reference_hash(ids: torch.Tensor) -> str:
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in ids.flatten().tolist())
    shape = b"".join(int(n).to_bytes(8, "little", signed=True) for n in ids.shape)
    return "sha256:" + hashlib.sha256(raw + shape).hexdigest()


def test_embedded_windows_are_the_concatenated_held_out_documents(tok):
    data = load_eval_data("embedded", tok, n_windows=6, window=100, layout="packed")
    stream = _reference_stream(tok, corpus.generate_documents(10, seed=corpus.EVAL_SEED))
    assert len(stream) >= 600
    expected = torch.tensor(stream[:600]).view(6, 100)
    assert data.input_ids.dtype == torch.long
    assert torch.equal(data.input_ids, expected)
    assert torch.equal(data.attention_mask, torch.ones(6, 100, dtype=torch.long))
    assert data.token_hash == _reference_hash(expected)
    assert data.describe() == {
        "spec": "embedded",
        "n_windows": 6,
        "window": 100,
        "layout": "packed",
        "token_hash": data.token_hash,
    }


def test_same_inputs_same_hash_and_seed_changes_it(tok):
    a = load_eval_data("embedded", tok, n_windows=4, window=64)
    b = load_eval_data("embedded", tok, n_windows=4, window=64)
    c = load_eval_data("embedded", tok, n_windows=4, window=64, seed=1)
    assert a.token_hash == b.token_hash
    assert a.token_hash != c.token_hash
    # more windows extend the same stream: the first windows do not move
    more = load_eval_data("embedded", tok, n_windows=40, window=64)
    assert torch.equal(more.input_ids[:4], a.input_ids)


def test_token_hash_covers_values_and_shape():
    ids = torch.arange(24, dtype=torch.long).view(4, 6)
    assert token_hash(ids) == _reference_hash(ids)
    assert token_hash(ids) != token_hash(ids.view(6, 4))
    changed = ids.clone()
    changed[3, 5] = 99
    assert token_hash(changed) != token_hash(ids)
    assert token_hash(ids.to(torch.int32)) == token_hash(ids)


def test_txt_file_without_blank_lines_is_one_document(tok, tmp_path):
    docs = corpus.generate_documents(4, seed=11)
    text = "\n".join(docs)
    path = tmp_path / "eval.txt"
    path.write_text(text)
    stream = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    window = 50
    n = len(stream) // window
    data = load_eval_data(str(path), tok, n_windows=n, window=window, layout="packed")
    assert torch.equal(data.input_ids.flatten(), torch.tensor(stream[: n * window]))
    assert data.spec == str(path)


def test_jsonl_reads_the_text_field_in_order(tok, tmp_path):
    docs = corpus.generate_documents(5, seed=12)
    path = tmp_path / "eval.jsonl"
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    stream = _reference_stream(tok, docs)
    data = load_eval_data(str(path), tok, n_windows=3, window=128, text_field="body", layout="packed")
    assert torch.equal(data.input_ids.flatten(), torch.tensor(stream[:384]))
    with pytest.raises(DataError, match="text-field"):
        load_eval_data(str(path), tok, n_windows=1, window=8, layout="packed")


def test_too_short_data_says_how_many_windows_fit(tok, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(" ".join(["copy"] * 99))  # 99 words + eos = 100 tokens
    with pytest.raises(DataError, match="100 tokens, enough for 3 windows of 30") as info:
        load_eval_data(str(path), tok, n_windows=4, window=30, layout="packed")
    assert "\n" not in str(info.value)
    assert load_eval_data(str(path), tok, n_windows=3, window=30, layout="packed").input_ids.shape == (3, 30)


@pytest.mark.parametrize("content", ["", "  \n\n"])
def test_empty_data_is_a_one_line_error(tok, tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(DataError, match="empty") as info:
        load_eval_data(str(path), tok, n_windows=1, window=4)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_specs_are_clear_errors(tok, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_eval_data(str(tmp_path / "missing.jsonl"), tok)
    with pytest.raises(DataError, match="unknown data spec"):
        load_eval_data(str(tmp_path / "data.csv"), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "copy"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_eval_data(str(bad), tok, n_windows=1, window=64)
    with pytest.raises(DataError, match="n_windows"):
        load_eval_data("embedded", tok, n_windows=0)


def test_parse_hf_spec():
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:test") == (
        "wikitext",
        "wikitext-2-raw-v1",
        "test",
    )
    assert parse_hf_spec("hf:allenai/c4:validation") == ("allenai/c4", None, "validation")
    for bad in ("hf:onlyname", "hf:a::b", "hf:a:b:c:d"):
        with pytest.raises(DataError, match="hf:NAME"):
            parse_hf_spec(bad)


def test_hf_dataset_from_a_local_folder_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ds"
    folder.mkdir()
    docs = corpus.generate_documents(4, seed=13)
    rows = [{"text": d} for d in docs[:2]] + [{"text": ""}] + [{"text": d} for d in docs[2:]]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = load_eval_data(f"hf:{folder}:train", tok, n_windows=2, window=200, layout="packed")
    assert torch.equal(data.input_ids.flatten(), torch.tensor(_reference_stream(tok, docs)[:400]))

    with pytest.raises(DataError, match="could not load dataset") as info:
        load_eval_data("hf:no-such-owner/no-such-dataset:train", tok, n_windows=1, window=4, layout="packed")
    assert "\n" not in str(info.value)


def test_tokenizer_without_eos_concatenates_documents(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    assert plain.eos_token_id is None
    path = tmp_path / "two.jsonl"
    path.write_text('{"text": "a a b"}\n{"text": "b a"}\n')
    data = load_eval_data(str(path), plain, n_windows=1, window=5, layout="packed")
    assert data.input_ids.tolist() == [[1, 1, 2, 2, 1]]


def test_batches_cover_every_window_once(tok):
    data = load_eval_data("embedded", tok, n_windows=7, window=16)
    batches = list(data.batches(3))
    assert [b[0].shape[0] for b in batches] == [3, 3, 1]
    assert torch.equal(torch.cat([b[0] for b in batches]), data.input_ids)
    assert torch.equal(torch.cat([b[1] for b in batches]), data.attention_mask)
    with pytest.raises(DataError, match="batch_size"):
        next(data.batches(0))


def test_eval_data_rejects_mismatched_shapes():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(DataError, match=r"\(N, T\)"):
        EvalData(ids, torch.ones(2, 4, dtype=torch.long), "x", token_hash(ids))


def test_pad_batch_left_and_right():
    seqs = [[5, 6, 7], torch.tensor([8]), []]
    ids, mask = pad_batch(seqs, pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids, mask = pad_batch(seqs, pad_id=-1, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, -1, -1], [-1, -1, -1]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    # the real tokens, read back through the mask, are the inputs
    rng = np.random.default_rng(0)
    many = [rng.integers(1, 50, size=rng.integers(1, 9)).tolist() for _ in range(20)]
    for side in ("left", "right"):
        ids, mask = pad_batch(many, pad_id=0, side=side)
        assert [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)] == many
    with pytest.raises(DataError, match="side"):
        pad_batch(seqs, 0, side="middle")
    with pytest.raises(DataError, match="at least one"):
        pad_batch([], 0)


def test_document_layout_puts_one_truncated_document_in_each_window(tok):
    window = 40
    data = load_eval_data("embedded", tok, n_windows=5, window=window)
    docs = [tok.encode(d, add_special_tokens=False)
            for d in corpus.generate_documents(5, seed=corpus.EVAL_SEED)]
    assert data.layout == "document"
    assert data.input_ids.shape == (5, window)
    for row, mask, doc in zip(data.input_ids, data.attention_mask, docs, strict=True):
        n = min(len(doc), window)
        assert row[:n].tolist() == doc[:n]  # the document's start, no eos, no other document
        assert mask.tolist() == [1] * n + [0] * (window - n)  # padding on the right only
        assert set(row[n:].tolist()) <= {tok.pad_token_id}
    described = data.describe()
    assert described["layout"] == "document"
    assert described["mask_hash"] == _reference_hash(data.attention_mask)


def test_document_layout_pads_short_documents_and_skips_one_token_ones(tok, tmp_path):
    path = tmp_path / "short.jsonl"
    words = corpus.VOCAB[10:14]
    path.write_text("\n".join(json.dumps({"text": t}) for t in
                              [f"{words[0]} {words[1]}", words[2], f"{words[3]} {words[0]} {words[1]}"]))
    data = load_eval_data(str(path), tok, n_windows=2, window=6)
    ids = [corpus.VOCAB.index(w) for w in words]
    pad = tok.pad_token_id
    assert data.input_ids.tolist() == [[ids[0], ids[1], pad, pad, pad, pad],
                                       [ids[3], ids[0], ids[1], pad, pad, pad]]
    assert data.attention_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]


def test_txt_documents_are_separated_by_blank_lines(tok, tmp_path):
    docs = corpus.generate_documents(3, seed=12)
    path = tmp_path / "three.txt"
    path.write_text("\n\n".join(docs) + "\n")
    data = load_eval_data(str(path), tok, n_windows=3, window=20)
    for row, doc in zip(data.input_ids, docs, strict=True):
        assert row.tolist()[:5] == tok.encode(doc, add_special_tokens=False)[:5]


def test_too_few_documents_for_the_document_layout_says_what_to_do(tok, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text(" ".join(corpus.generate_documents(3, seed=2)))
    with pytest.raises(DataError, match="1 documents.*--layout packed"):
        load_eval_data(str(path), tok, n_windows=4, window=16)
    with pytest.raises(DataError, match="unknown layout"):
        load_eval_data(str(path), tok, n_windows=1, window=16, layout="shuffled")


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        (_Config(n_positions=64), 64),  # GPT-2: learned positions
        (_Config(max_position_embeddings=128), 128),  # Qwen3 / Llama: rotary, trained context
        (_Config(max_position_embeddings=4096), 4096),
        (_Config(), None),
    ],
)
def test_window_is_clamped_by_default_and_refused_when_explicit(config, limit):
    from peakprobe.data import DEFAULT_WINDOW, WindowNotice, max_positions, window_for

    assert max_positions(config) == limit
    if limit is not None and limit < DEFAULT_WINDOW:
        with pytest.warns(WindowNotice, match=f"windows of {limit} tokens"):
            assert window_for(config, None) == limit
        with pytest.raises(DataError, match=f"exceed the model's maximum positions \\({limit}\\)"):
            window_for(config, limit + 1)
        assert window_for(config, limit) == limit
    else:
        assert window_for(config, None) == DEFAULT_WINDOW
        assert window_for(config, 2 * DEFAULT_WINDOW) == 2 * DEFAULT_WINDOW
