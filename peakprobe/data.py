"""The evaluation tokens: fixed windows, identical for every checkpoint, and their hash.

``load_eval_data(spec, tokenizer)`` turns one of

* ``embedded`` — the generated corpus of ``peakprobe.toy.corpus`` (held out from training seeds),
* a path to a ``.txt`` file (the whole text is one document),
* a path to a ``.jsonl`` file (one document per line, in its ``text_field``),
* ``hf:NAME[:CONFIG]:SPLIT`` — a ``datasets`` dataset, loaded through the user's own cache and
  configuration (``HF_DATASETS_OFFLINE=1`` is honoured by ``datasets`` itself),

into ``n_windows`` windows of ``window`` tokens: documents are tokenized in order (no special
tokens), each followed by the tokenizer's eos token, concatenated, and cut into consecutive
non-overlapping windows; the first ``n_windows`` are kept. Nothing is shuffled, so the same
inputs always give the same windows. The windows are full, so the attention mask is all ones.

``token_hash`` identifies the windows in the run manifest: ``"sha256:"`` + the hex SHA-256 of
the tokens as little-endian int64 bytes (row-major) followed by the shape ``(N, T)`` as two
little-endian int64 values.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EMBEDDED = "embedded"
HF_PREFIX = "hf:"
_DOC_CHUNK = 64  # documents tokenized per call


class DataError(ValueError):
    """Evaluation data that cannot be loaded or is too short."""


def token_hash(input_ids: torch.Tensor) -> str:
    """``sha256:`` + hash of the int64 little-endian token bytes followed by the int64 shape."""
    array = np.ascontiguousarray(input_ids.detach().cpu().numpy().astype("<i8"))
    digest = hashlib.sha256(array.tobytes())
    digest.update(np.asarray(array.shape, dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()


@dataclass
class EvalData:
    """Fixed evaluation windows: ``input_ids`` and ``attention_mask`` are LongTensor (N, T)."""

    input_ids: torch.Tensor  # (N, T) int64
    attention_mask: torch.Tensor  # (N, T) int64
    spec: str
    token_hash: str

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise DataError(
                "input_ids and attention_mask must both be (N, T); got "
                f"{tuple(self.input_ids.shape)} and {tuple(self.attention_mask.shape)}"
            )

    @property
    def n_windows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def window(self) -> int:
        return int(self.input_ids.shape[1])

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Consecutive (input_ids, attention_mask) slices of at most ``batch_size`` windows."""
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, self.n_windows, batch_size):
            stop = start + batch_size
            yield self.input_ids[start:stop], self.attention_mask[start:stop]  # (b, T), (b, T)

    def describe(self) -> dict:
        """The manifest's ``data`` entry."""
        return {
            "spec": self.spec,
            "n_windows": self.n_windows,
            "window": self.window,
            "token_hash": self.token_hash,
        }


def _embedded_docs(seed: int) -> Iterator[str]:
    from peakprobe.toy import corpus

    start = 0
    while True:
        yield from corpus.generate_documents(_DOC_CHUNK, seed=corpus.EVAL_SEED + seed, start=start)
        start += _DOC_CHUNK


def _text_docs(path: Path) -> Iterator[str]:
    yield path.read_text(encoding="utf-8")


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DataError(
                    f"{path}:{number} has no string field {text_field!r}; pass --text-field NAME"
                )
            yield record[text_field]


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:CONFIG]:SPLIT`` -> (name, config or None, split)."""
    parts = spec[len(HF_PREFIX):].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise DataError(f"bad dataset spec {spec!r}; write hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def _hf_docs(spec: str, text_field: str) -> Iterator[str]:
    name, config, split = parse_hf_spec(spec)
    try:
        import datasets

        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many types; all mean "cannot load"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"could not load dataset {name!r} (config {config!r}, split {split!r}): {first}; "
            "check the name, or give a local .txt/.jsonl file"
        ) from None
    if text_field not in dataset.column_names:
        raise DataError(
            f"dataset {name!r} has no column {text_field!r} (columns: {dataset.column_names}); "
            "pass --text-field NAME"
        )
    for batch in dataset.iter(batch_size=256):
        for text in batch[text_field]:
            yield text if isinstance(text, str) else ""


def _documents(spec: str, text_field: str, seed: int) -> Iterator[str]:
    if spec == EMBEDDED:
        return _embedded_docs(seed)
    if spec.startswith(HF_PREFIX):
        return _hf_docs(spec, text_field)
    path = Path(os.path.expanduser(spec))
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise DataError(
            f"unknown data spec {spec!r}; use 'embedded', a .txt or .jsonl file, or hf:NAME[:CONFIG]:SPLIT"
        )
    if not path.is_file():
        raise DataError(f"data file {spec!r} does not exist")
    return _text_docs(path) if suffix == ".txt" else _jsonl_docs(path, text_field)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        if doc.strip():
            chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_eval_data(
    spec: str,
    tokenizer,
    *,
    n_windows: int = 64,
    window: int = 256,
    seed: int = 0,
    text_field: str = "text",
) -> EvalData:
    """The first ``n_windows`` windows of ``window`` tokens of ``spec`` (see the module docstring).

    ``tokenizer`` is the checkpoint's (any ``transformers`` tokenizer). ``seed`` only picks the
    stream of the ``embedded`` corpus; file and dataset inputs are read in order. Raises
    DataError when the data is empty, too short, or cannot be read.
    """
    if n_windows < 1 or window < 1:
        raise DataError(f"n_windows and window must be >= 1, got {n_windows} and {window}")
    need = n_windows * window
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for chunk in _chunks(_documents(spec, text_field, seed), _DOC_CHUNK):
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
        for doc_ids in encoded:
            ids.extend(doc_ids)
            if eos is not None:
                ids.append(eos)
        if len(ids) >= need:
            break
    if not ids:
        raise DataError(f"data {spec!r} is empty (no tokens); give a file or dataset with text")
    if len(ids) < need:
        available = len(ids) // window
        raise DataError(
            f"data {spec!r} has {len(ids)} tokens, enough for {available} windows of {window}, "
            f"not {n_windows}; lower --n-windows or --window, or give more text"
        )
    input_ids = torch.tensor(ids[:need], dtype=torch.long).view(n_windows, window)  # (N, T)
    attention_mask = torch.ones_like(input_ids)  # (N, T)
    return EvalData(input_ids, attention_mask, spec, token_hash(input_ids))


def pad_batch(
    sequences: Sequence[Sequence[int] | torch.Tensor], pad_id: int, side: str = "left"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token sequences to one length: (input_ids, attention_mask), both LongTensor (B, T).

    ``side="left"`` puts the padding before each sequence (as for generation), ``"right"`` after.
    """
    if side not in ("left", "right"):
        raise DataError(f"side must be 'left' or 'right', got {side!r}")
    if len(sequences) == 0:
        raise DataError("pad_batch needs at least one sequence")
    rows = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    length = max(int(r.numel()) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        n = int(row.numel())
        if n == 0:
            continue
        cols = slice(length - n, length) if side == "left" else slice(0, n)
        input_ids[i, cols] = row
        attention_mask[i, cols] = 1
    return input_ids, attention_mask
