"""The evaluation tokens: fixed windows, identical for every checkpoint, and their hash.

``load_eval_data(spec, tokenizer)`` reads documents from one of

* ``embedded`` — the generated corpus of ``peakprobe.corpus`` (a held-out seed stream),
* a path to a ``.txt`` file (documents are separated by blank lines),
* a path to a ``.jsonl`` file (one document per line, in its ``text_field``),
* ``hf:NAME[:CONFIG]:SPLIT`` — a ``datasets`` dataset, loaded through the user's own cache and
  configuration (``HF_DATASETS_OFFLINE=1`` is honoured by ``datasets`` itself),

and lays them out as ``n_windows`` windows of ``window`` tokens (no special tokens added):

* ``layout="document"`` (the default, as the authors of the 1/3 work measure Pythia): one
  document per window, truncated to ``window`` tokens and padded on the right; the attention
  mask marks the real tokens. Documents with fewer than 2 tokens are skipped (no next token).
* ``layout="packed"``: documents tokenized in order, each followed by the eos token,
  concatenated and cut into consecutive full windows (mask all ones); every token attends to
  every earlier token of its window, across document boundaries.
* ``layout="packed-docs"``: the same windows, with ``position_ids`` restarting at 0 at each
  document's first token in the window, as ``DataCollatorWithFlattening`` builds them: the
  model masks attention to the document (its own block-diagonal mask) and the LM head has no
  target across a boundary, so every statistic is per document.

Nothing is shuffled, so the same inputs always give the same windows. The manifest records the
layout and ``token_hash``: ``"sha256:"`` + the hex SHA-256 of the tokens as little-endian int64
bytes (row-major) followed by the shape ``(N, T)`` as two little-endian int64 values; the
document layout also records ``mask_hash``, the same hash of the attention mask.

The window must fit the model: ``window_for(config, window)`` gives the default (1024 tokens,
clamped to the model's maximum positions, with a notice) and refuses an explicit window longer
than the model's maximum positions with a one-line :class:`DataError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .vocab import DOCUMENT, LAYOUTS, PACKED, PACKED_DOCS, PeakprobeError, PeakprobeWarning

EMBEDDED = "embedded"
HF_PREFIX = "hf:"

#: the default window (the authors' 1024 tokens), clamped to the model's maximum positions
DEFAULT_WINDOW = 1024
#: config attributes that bound the positions a model was built (or trained) for
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
_DOC_CHUNK = 64  # documents tokenized per call


class DataError(PeakprobeError):
    """Evaluation data that cannot be loaded or is too short."""


def token_hash(input_ids: torch.Tensor) -> str:
    """``sha256:`` + hash of the int64 little-endian token bytes followed by the int64 shape."""
    array = np.ascontiguousarray(input_ids.detach().cpu().numpy().astype("<i8"))
    digest = hashlib.sha256(array.tobytes())
    digest.update(np.asarray(array.shape, dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()


@dataclass
class EvalData:
    """Fixed evaluation windows: ``input_ids`` and ``attention_mask`` are LongTensor (N, T);
    ``position_ids`` (N, T) restart at every packed document (layout ``packed-docs``), else None."""

    input_ids: torch.Tensor  # (N, T) int64
    attention_mask: torch.Tensor  # (N, T) int64
    spec: str
    token_hash: str
    layout: str = PACKED
    position_ids: torch.Tensor | None = None  # (N, T) int64

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

    def batches(self, batch_size: int, n_windows: int | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Consecutive (input_ids, attention_mask, position_ids) slices of at most ``batch_size``
        windows (of the first ``n_windows``, default all). Packed documents come with their
        position ids and no mask (the model then builds each document's own mask); the other
        layouts with their mask and no position ids."""
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        n = self.n_windows if n_windows is None else min(n_windows, self.n_windows)
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            if self.position_ids is not None:
                yield self.input_ids[start:stop], None, self.position_ids[start:stop]
            else:
                yield self.input_ids[start:stop], self.attention_mask[start:stop], None  # (b, T) each

    def describe(self) -> dict:
        """The manifest's ``data`` entry."""
        out = {
            "spec": self.spec,
            "n_windows": self.n_windows,
            "window": self.window,
            "layout": self.layout,
            "token_hash": self.token_hash,
        }
        if self.layout == DOCUMENT:
            out["mask_hash"] = token_hash(self.attention_mask)
        if self.position_ids is not None:
            out["positions_hash"] = token_hash(self.position_ids)
        return out


class WindowNotice(PeakprobeWarning):
    """The default window was shortened to fit the model's maximum positions."""


def max_positions(config) -> int | None:
    """The longest sequence the model's config admits (learned positions, or the trained
    context of rotary models), or None when the config states none."""
    for key in _MAX_POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def window_for(config, window: int | None) -> int:
    """The window to use for a model with ``config``.

    ``window=None`` means the default: DEFAULT_WINDOW tokens, clamped (with a WindowNotice) to the
    model's maximum positions. An explicit window longer than those is refused: positions past
    them are an IndexError for learned position embeddings and untrained context for rotary ones.
    """
    limit = max_positions(config)
    if window is None:
        if limit is not None and limit < DEFAULT_WINDOW:
            warnings.warn(
                f"windows of {limit} tokens: the model's maximum positions "
                f"({limit}) are fewer than the default {DEFAULT_WINDOW}",
                WindowNotice, stacklevel=2,
            )
            return limit
        return DEFAULT_WINDOW
    if window < 1:
        raise DataError(f"window must be >= 1, got {window}")
    if limit is not None and window > limit:
        raise DataError(
            f"windows of {window} tokens exceed the model's maximum positions ({limit}); "
            f"use --window {limit} or less"
        )
    return window


def _embedded_docs(seed: int) -> Iterator[str]:
    from peakprobe import corpus

    start = 0
    while True:
        yield from corpus.generate_documents(_DOC_CHUNK, seed=corpus.EVAL_SEED + seed, start=start)
        start += _DOC_CHUNK


def _not_utf8(path: Path, raw: bytes, err: UnicodeDecodeError, line: int | None = None) -> DataError:
    """The one-line error of a file that is not UTF-8 text: the file, the line and the byte."""
    line = raw[: err.start].count(b"\n") + 1 if line is None else line
    return DataError(f"{path}:{line} is not UTF-8 text (byte 0x{raw[err.start]:02x}); "
                     "save the file as UTF-8")


def _text_docs(path: Path) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, raw, err) from None
    for paragraph in text.replace("\r\n", "\n").split("\n\n"):
        if paragraph.strip():
            yield paragraph


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, raw, err, number) from None
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
    window: int = DEFAULT_WINDOW,
    seed: int = 0,
    text_field: str = "text",
    layout: str = DOCUMENT,
) -> EvalData:
    """``n_windows`` windows of ``window`` tokens of ``spec`` in ``layout`` (module docstring).

    ``tokenizer`` is the checkpoint's (any ``transformers`` tokenizer). ``seed`` only picks the
    stream of the ``embedded`` corpus; file and dataset inputs are read in order. Raises
    DataError when the data is empty, too short, or cannot be read.
    """
    if n_windows < 1 or window < 1:
        raise DataError(f"n_windows and window must be >= 1, got {n_windows} and {window}")
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    docs = _chunks(_documents(spec, text_field, seed), _DOC_CHUNK)
    if layout == DOCUMENT:
        return _document_windows(docs, tokenizer, spec, n_windows, window)
    return _packed_windows(docs, tokenizer, spec, n_windows, window, documents=layout == PACKED_DOCS)


def _encode(tokenizer, chunk: list[str]) -> list[list[int]]:
    return tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]


def _packed_windows(docs, tokenizer, spec: str, n_windows: int, window: int, *,
                    documents: bool = False) -> EvalData:
    need = n_windows * window
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    pos: list[int] = []  # each token's position in its document
    for chunk in docs:
        for doc_ids in _encode(tokenizer, chunk):
            doc = list(doc_ids) + ([] if eos is None else [eos])
            ids.extend(doc)
            pos.extend(range(len(doc)))
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
    if not documents:
        return EvalData(input_ids, attention_mask, spec, token_hash(input_ids), PACKED)
    # a document cut by a window boundary starts the next window as a document of its own
    position_ids = torch.tensor(pos[:need], dtype=torch.long).view(n_windows, window)  # (N, T)
    position_ids = position_ids - _segment_first(position_ids)
    return EvalData(input_ids, attention_mask, spec, token_hash(input_ids), PACKED_DOCS, position_ids)


def _segment_first(pos: torch.Tensor) -> torch.Tensor:
    """(N, T): the position id at the start of each token's document segment in its window."""
    t = pos.shape[1]
    idx = torch.arange(t).expand_as(pos)
    start = torch.where((pos == 0) | (idx == 0), idx, torch.zeros_like(idx)).cummax(-1).values
    return pos.gather(1, start)


def _document_windows(docs, tokenizer, spec: str, n_windows: int, window: int) -> EvalData:
    rows: list[list[int]] = []
    for chunk in docs:
        rows.extend(ids[:window] for ids in _encode(tokenizer, chunk) if len(ids) >= 2)
        if len(rows) >= n_windows:
            break
    if not rows:
        raise DataError(f"data {spec!r} is empty (no document of 2 or more tokens)")
    if len(rows) < n_windows:
        raise DataError(
            f"data {spec!r} has {len(rows)} documents of 2 or more tokens, not {n_windows}: "
            "the default layout puts one document in each window; lower --n-windows, give more "
            "documents, or pass --layout packed"
        )
    pad = tokenizer.pad_token_id
    pad = tokenizer.eos_token_id if pad is None else pad
    input_ids, attention_mask = pad_batch(rows[:n_windows], 0 if pad is None else pad, "right")
    if input_ids.shape[1] < window:  # every document was shorter: pad to the full window
        extra = window - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=0 if pad is None else pad)
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=0)
    return EvalData(input_ids, attention_mask, spec, token_hash(input_ids), DOCUMENT)


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
