"""The embedded corpus: generated text whose structure forces attention to concentrate.

Everything here is code, not downloaded text. A fixed vocabulary of pseudo-words is built from
syllables (the same for every seed); documents are then drawn from a seeded generator and mix
three kinds of segment:

* **filler** sentences: Zipf-distributed words with a weak bigram habit (each word has a
  preferred follower), ending in ``.`` — learnable from the current token alone;
* **copy** segments: ``copy : w1 .. wk .`` with ``COPY_SPAN`` uniformly random words, repeated
  later in the same document as ``again : w1 .. wk .`` — predicting the repeat needs an
  induction head that attends sharply to the earlier occurrence (and, under it, a head that
  reads the previous token);
* **key-value** segments: ``set k1 = v1 , k2 = v2 ... .`` followed later by ``get k2 = v2 .`` —
  predicting ``v2`` needs attention to the one earlier position where ``k2 =`` appeared.

Document ``i`` of seed ``s`` depends only on ``(s, i)``, so ``generate_documents(n)`` is a prefix
of ``generate_documents(m)`` for ``n < m``. The tokenizer is a ``tokenizers`` WordLevel model
with a whitespace pre-tokenizer and ``<bos>``/``<eos>``/``<pad>``/``<unk>`` specials.
"""

from __future__ import annotations

import numpy as np

from .vocab import PeakprobeError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
MARKERS = (".", ",", ":", "=", "copy", "again", "set", "get")
N_WORDS = 1000
ZIPF_EXPONENT = 1.1
ZIPF_OFFSET = 2.7
FOLLOW_PROB = 0.4
FILLER_SHARE = 0.3  # probability that a new segment is a filler sentence
COPY_SHARE = 0.5  # ... a copy segment (the rest are key-value segments)
#: words in a copy segment: long repeats make copying worth a head early in training (spans
#: of 4 to 10 words leave the demo's tiny LM with no positional head after its 800 updates)
COPY_SPAN = (12, 24)
EVAL_SEED = 987_654

_VOCAB_SEED = 20_260_203
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "kr", "st", "tr")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "k")


class CorpusError(PeakprobeError):
    """A corpus argument is out of range."""


def _make_words() -> tuple[str, ...]:
    """The filler vocabulary: N_WORDS distinct pseudo-words, in Zipf-rank order."""
    rng = np.random.default_rng(_VOCAB_SEED)
    reserved = set(MARKERS) | set(SPECIAL_TOKENS)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < N_WORDS:
        n_syllables = int(rng.integers(1, 4))
        word = "".join(
            _ONSETS[rng.integers(len(_ONSETS))]
            + _NUCLEI[rng.integers(len(_NUCLEI))]
            + _CODAS[rng.integers(len(_CODAS))]
            for _ in range(n_syllables)
        )
        if word not in seen and word not in reserved:
            seen.add(word)
            words.append(word)
    return tuple(words)


WORDS: tuple[str, ...] = _make_words()
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + MARKERS + WORDS

_ranks = np.arange(N_WORDS, dtype=np.float64)
_zipf = (_ranks + ZIPF_OFFSET) ** (-ZIPF_EXPONENT)
ZIPF_PROBS: np.ndarray = _zipf / _zipf.sum()  # (N_WORDS,)
_ZIPF_CDF = np.cumsum(ZIPF_PROBS)
# each filler word's preferred follower (a fixed permutation, the same for every seed)
FOLLOWER: np.ndarray = np.random.default_rng(_VOCAB_SEED + 1).permutation(N_WORDS)  # (N_WORDS,)


def _zipf_words(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` word indices drawn from the Zipf law."""
    idx = np.searchsorted(_ZIPF_CDF, rng.random(n) * _ZIPF_CDF[-1], side="right")
    return np.minimum(idx, N_WORDS - 1)


def _filler(rng: np.random.Generator) -> list[str]:
    length = int(rng.integers(4, 15))
    draws = _zipf_words(rng, length)
    follow = rng.random(length) < FOLLOW_PROB
    out = [int(draws[0])]
    for j in range(1, length):
        out.append(int(FOLLOWER[out[-1]]) if follow[j] else int(draws[j]))
    return [WORDS[w] for w in out] + ["."]


def _random_span(rng: np.random.Generator, lo: int, hi: int) -> list[str]:
    return [WORDS[w] for w in rng.integers(0, N_WORDS, size=int(rng.integers(lo, hi + 1)))]


def _document(rng: np.random.Generator) -> list[str]:
    """One document as a flat word list: segments in order, each recall after its source."""
    n_segments = int(rng.integers(8, 20))
    pending: list[tuple[int, list[str]]] = []  # (segment index at which to emit, words)
    words: list[str] = []
    for s in range(n_segments):
        due = [p for p in pending if p[0] <= s]
        if due:
            pending.remove(due[0])
            words += due[0][1]
            continue
        kind = rng.random()
        if kind < FILLER_SHARE:
            words += _filler(rng)
        elif kind < FILLER_SHARE + COPY_SHARE:
            span = _random_span(rng, *COPY_SPAN)
            words += ["copy", ":", *span, "."]
            pending.append((s + int(rng.integers(1, 5)), ["again", ":", *span, "."]))
        else:
            n_pairs = int(rng.integers(2, 5))
            keys = rng.choice(N_WORDS, size=n_pairs, replace=False)
            values = rng.integers(0, N_WORDS, size=n_pairs)
            for j in range(n_pairs):
                words += ["set" if j == 0 else ",", WORDS[keys[j]], "=", WORDS[values[j]]]
            words.append(".")
            ask = int(rng.integers(n_pairs))
            recall = ["get", WORDS[keys[ask]], "=", WORDS[values[ask]], "."]
            pending.append((s + int(rng.integers(1, 4)), recall))
    for _, recall in pending:
        words += recall
    return words


def generate_documents(n_docs: int, *, seed: int = 0, start: int = 0) -> list[str]:
    """Documents ``start .. start + n_docs - 1`` of the stream ``seed``, as space-separated words.

    Document ``i`` depends only on ``(seed, i)``, so streams can be generated in pieces.
    """
    if n_docs < 0 or start < 0:
        raise CorpusError(f"n_docs and start must be >= 0, got n_docs={n_docs}, start={start}")
    if seed < 0:
        raise CorpusError(f"seed must be >= 0, got {seed}")
    return [" ".join(_document(np.random.default_rng([seed, i]))) for i in range(start, start + n_docs)]


def build_tokenizer(model_max_length: int = 2048):
    """A fast word-level tokenizer over ``VOCAB`` (a ``transformers.PreTrainedTokenizerFast``).

    It adds no special tokens when encoding; callers join documents with ``eos_token``.
    ``save_pretrained`` writes ``tokenizer.json`` so ``AutoTokenizer.from_pretrained`` reloads it
    offline.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
    )
