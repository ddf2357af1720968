"""The run-directory contract: the tidy results schema, atomic writes, and reading a run back.

A run directory holds ``manifest.json``, one ``checkpoints/<revision>.parquet`` per finished
checkpoint, ``failures.jsonl``, ``integrity.json`` (checkpoints whose weights duplicate
another's), ``locks/`` (one lock file per checkpoint being probed), and later ``fits.parquet`` /
``fits.json`` / ``report/``.
Every stage reads and writes it only through this module, so the format lives in one place
(see docs/architecture.md).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .vocab import INTEGRITY, PeakprobeError

FORMAT = 1

RESULT_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("revision", pa.string()),
        ("step", pa.int64()),
        ("tokens", pa.int64()),
        ("tau", pa.float64()),
        ("site_kind", pa.string()),
        ("layer", pa.int64()),
        ("head", pa.int64()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("n_rows", pa.int64()),
    ]
)
SORT_KEYS = ["site_kind", "layer", "head", "metric"]

#: fits.parquet: one row per fit (docs/architecture.md).
FITS_SCHEMA = pa.schema(
    [
        ("fit", pa.string()),
        ("site_kind", pa.string()),
        ("layer", pa.int64()),
        ("head", pa.int64()),
        ("metric", pa.string()),
        ("time_axis", pa.string()),
        ("t_min", pa.float64()),
        ("t_max", pa.float64()),
        ("n_points", pa.int64()),
        ("alpha", pa.float64()),
        ("alpha_lo", pa.float64()),
        ("alpha_hi", pa.float64()),
        ("c", pa.float64()),
        ("L0", pa.float64()),
        ("L0_lo", pa.float64()),
        ("L0_hi", pa.float64()),
        ("r2", pa.float64()),
        ("monotone", pa.bool_()),
        ("flags", pa.string()),
        ("first_value", pa.float64()),
        ("final_value", pa.float64()),
        ("verdict", pa.string()),
        ("band_lo", pa.float64()),
        ("band_hi", pa.float64()),
        ("third_in_ci", pa.bool_()),
        ("peaked", pa.bool_()),
        ("site_class", pa.string()),
        ("alpha_late", pa.float64()),
        ("alpha_late_lo", pa.float64()),
        ("alpha_late_hi", pa.float64()),
        ("p_growing", pa.float64()),
        ("q_growing", pa.float64()),
        ("share", pa.float64()),
        ("share_lo", pa.float64()),
        ("share_hi", pa.float64()),
        ("p_share", pa.float64()),
        ("q_share", pa.float64()),
        ("sensitivity", pa.float64()),
    ]
)

MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
FAILURES = "failures.jsonl"
FITS = "fits.parquet"
FITS_JSON = "fits.json"
REPORT = "report"
LOCKS = "locks"


class RunDirError(PeakprobeError):
    """A run directory is missing, empty or inconsistent."""


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no partial file is ever visible under its name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(obj: Any) -> Any:
    """A copy of ``obj`` that JSON can hold: numpy scalars as Python numbers, NaN and infinities
    as None, tuples as lists, keys as strings, anything else (a path) as its text."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return None if pd.isna(obj) else str(obj)


def _dumps(obj: Any, **kwargs) -> str:
    return json.dumps(json_safe(obj), sort_keys=True, allow_nan=False, **kwargs)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON, atomically; NaN and infinities are written as
    null (``json_safe``)."""
    text = _dumps(obj, indent=2) + "\n"
    write_bytes(Path(path), text.encode())


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def table_bytes(df: pd.DataFrame, schema: pa.Schema | None = None) -> bytes:
    """Serialize a frame to parquet bytes deterministically (no pandas metadata, fixed schema)."""
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    table = table.replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_statistics=False)
    return sink.getvalue().to_pybytes()


def write_parquet(path: str | os.PathLike, df: pd.DataFrame, schema: pa.Schema | None = None) -> None:
    """Write ``df`` to ``path`` atomically; the same frame always gives the same bytes."""
    write_bytes(Path(path), table_bytes(df, schema))


def checkpoint_path(run_dir: str | os.PathLike, revision: str) -> Path:
    safe = revision.replace("/", "__")
    return Path(run_dir) / CHECKPOINTS / f"{safe}.parquet"


def write_checkpoint(run_dir: str | os.PathLike, revision: str, df: pd.DataFrame) -> Path:
    """Write one checkpoint's tidy results (sorted, fixed schema) atomically."""
    df = df[RESULT_SCHEMA.names].sort_values(SORT_KEYS, kind="stable").reset_index(drop=True)
    path = checkpoint_path(run_dir, revision)
    write_parquet(path, df, RESULT_SCHEMA)
    return path


def append_failure(run_dir: str | os.PathLike, record: dict) -> None:
    """Append one line to failures.jsonl (a failed checkpoint never stops the sweep)."""
    path = Path(run_dir) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(_dumps(record) + "\n")


def read_failures(run_dir: str | os.PathLike) -> list[dict]:
    """The latest failure of each checkpoint that has not been written since (a checkpoint that
    failed and later succeeded on resume is not a failure)."""
    path = Path(run_dir) / FAILURES
    if not path.exists():
        return []
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest.pop(record.get("revision"), None)  # keep file order, latest record wins
            latest[record.get("revision")] = record
    return [r for rev, r in latest.items() if rev is None or not checkpoint_path(run_dir, rev).exists()]


def write_integrity(run_dir: str | os.PathLike, record: dict) -> None:
    """Write ``integrity.json`` (format in docs/architecture.md) atomically."""
    write_json(Path(run_dir) / INTEGRITY, record)


def read_integrity_record(run_dir: str | os.PathLike) -> dict | None:
    """The run's whole ``integrity.json`` (format in docs/architecture.md), None when absent:
    the one reader of that file."""
    path = Path(run_dir) / INTEGRITY
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise RunDirError(f"{path} is not a JSON object; re-run the sweep's integrity check")
    return data


def read_integrity(run_dir: str | os.PathLike) -> dict[str, dict]:
    """Flagged checkpoints of a run: ``{revision: {"step", "duplicates", "files", "whole"}}``.

    Its keys are the revisions to exclude from fits (``set(read_integrity(run))``); empty when
    the run has no ``integrity.json``."""
    return dict((read_integrity_record(run_dir) or {}).get("flagged") or {})


def read_manifest(run_dir: str | os.PathLike) -> dict:
    """The run's manifest (``manifest.json``, layout in docs/architecture.md)."""
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        raise RunDirError(f"{run_dir} is not a peakprobe run directory (no {MANIFEST})")
    return read_json(path)


#: the manifest entries that must match for results to be mixed in one run directory
IDENTITY_KEYS: tuple[str, ...] = ("format", "model", "source", "checkpoints", "data", "probe",
                                  "attribution", "load")


def run_identity(manifest: dict, keys: tuple[str, ...] = IDENTITY_KEYS) -> dict:
    """What of a manifest makes a run: two manifests with equal identities may share a run
    directory (a sweep resumes into it, a live run continues it)."""
    return {k: manifest.get(k) for k in keys}


def read_results(run_dir: str | os.PathLike) -> pd.DataFrame:
    """All finished checkpoints of a run as one tidy frame, ordered by step then site."""
    files = sorted((Path(run_dir) / CHECKPOINTS).glob("*.parquet"))
    if not files:
        raise RunDirError(f"{run_dir} has no finished checkpoints (nothing in {CHECKPOINTS}/)")
    df = pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
    return df.sort_values(["step", *SORT_KEYS], kind="stable").reset_index(drop=True)
