"""The embedded corpus and its tokenizer: determinism, structure, Zipf law, offline round trip."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from peakprobe import corpus


def _sentences(doc: str) -> list[list[str]]:
    """Split a document at '.' into word lists (brute force, independent of the generator)."""
    out, cur = [], []
    for word in doc.split():
        cur.append(word)
        if word == ".":
            out.append(cur)
            cur = []
    assert not cur, "every segment ends with '.'"
    return out


def test_documents_are_deterministic_and_seeded():
    a = corpus.generate_documents(6, seed=3)
    assert a == corpus.generate_documents(6, seed=3)
    b = corpus.generate_documents(6, seed=4)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert len(set(a)) == 6


def test_documents_can_be_generated_in_pieces():
    whole = corpus.generate_documents(7, seed=2)
    assert corpus.generate_documents(3, seed=2) == whole[:3]
    assert corpus.generate_documents(4, seed=2, start=3) == whole[3:]


def test_the_evaluation_stream_is_held_out_from_training():
    held_out = corpus.generate_documents(5, seed=corpus.EVAL_SEED)
    assert set(held_out).isdisjoint(corpus.generate_documents(50, seed=0))


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="n_docs"):
        corpus.generate_documents(-1)
    with pytest.raises(ValueError, match="seed"):
        corpus.generate_documents(1, seed=-2)


def test_every_recall_repeats_an_earlier_segment():
    docs = corpus.generate_documents(120, seed=1)
    n_again = n_get = 0
    for doc in docs:
        sentences = _sentences(doc)
        for i, s in enumerate(sentences):
            earlier = sentences[:i]
            if s[0] == "again":
                n_again += 1
                span = s[2:-1]
                assert s[1] == ":" and corpus.COPY_SPAN[0] <= len(span) <= corpus.COPY_SPAN[1]
                assert ["copy", ":", *span, "."] in earlier
            elif s[0] == "get":
                n_get += 1
                key, value = s[1], s[3]
                assert s[2] == "=" and len(s) == 5
                pairs = set()
                for e in earlier:
                    if e[0] == "set":
                        body = e[1:-1]  # k = v , k = v ...
                        pairs |= {(body[j], body[j + 2]) for j in range(0, len(body), 4)}
                assert (key, value) in pairs
    assert n_again > 100 and n_get > 50


def test_vocabulary_size_and_coverage():
    assert 500 <= len(corpus.VOCAB) <= 2000
    assert len(set(corpus.VOCAB)) == len(corpus.VOCAB)
    words = Counter(w for d in corpus.generate_documents(80, seed=0) for w in d.split())
    assert set(words) <= set(corpus.VOCAB)
    assert len(words) > 0.8 * corpus.N_WORDS  # the head really sees a large vocabulary


def test_sentence_initial_filler_words_follow_the_zipf_law():
    # Filler sentences start with a fresh Zipf draw: p(r) proportional to (r + 2.7)^-1.1.
    rank = {w: i for i, w in enumerate(corpus.WORDS)}
    counts = np.zeros(corpus.N_WORDS)
    for doc in corpus.generate_documents(3000, seed=5):
        for s in _sentences(doc):
            if s[0] in rank:
                counts[rank[s[0]]] += 1
    total = counts.sum()
    expected = (np.arange(corpus.N_WORDS) + 2.7) ** -1.1
    expected /= expected.sum()
    for r in (0, 1, 5, 20):  # each within 4 binomial standard deviations
        sigma = math.sqrt(total * expected[r] * (1 - expected[r]))
        assert abs(counts[r] - total * expected[r]) < 4 * sigma
    ranks = np.arange(40)
    slope = np.polyfit(np.log(ranks + 2.7), np.log(counts[:40] / total), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.12)


def test_tokenizer_round_trip_and_specials(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tok = corpus.build_tokenizer()
    assert len(tok) == len(corpus.VOCAB)
    for name in ("bos", "eos", "pad", "unk"):
        token = getattr(tok, f"{name}_token")
        assert tok.convert_tokens_to_ids(token) == corpus.VOCAB.index(token)
    doc = corpus.generate_documents(1, seed=9)[0]
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    assert ids == [corpus.VOCAB.index(w) for w in doc.split()]
    assert tok.decode(ids) == doc
    assert tok("zzqx copy", add_special_tokens=False)["input_ids"] == [
        tok.unk_token_id,
        corpus.VOCAB.index("copy"),
    ]

    tok.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(doc, add_special_tokens=False)["input_ids"] == ids
    assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
