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
import shlex
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


class DamagedFileError(RunDirError):
    """A file of a run directory does not read back (truncated, emptied, edited, or copied in
    from another run): one line naming the file and the command that writes it again."""


#: the suffix a damaged checkpoint file is moved aside under (``step128.parquet.damaged``)
DAMAGED = ".damaged"


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


def _why(exc: BaseException) -> str:
    """A short reason for a file that does not read back: the error's kind and first line."""
    if isinstance(exc, UnicodeDecodeError):
        return "not text"
    text = str(exc).strip().splitlines()
    text = text[0].split("': ")[-1].split(". ")[0] if text else ""  # not pyarrow's path prefix
    return f"{type(exc).__name__}: {text[:100]}" if text else type(exc).__name__


def read_json_object(path: Path, fix: str) -> dict:
    """A JSON object from ``path``, or a one-line :class:`DamagedFileError` naming it and ``fix``."""
    try:
        if path.stat().st_size == 0:
            raise DamagedFileError(f"{path} is empty (0 bytes); {fix}")
        data = read_json(path)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DamagedFileError(f"{path} does not read back ({_why(exc)}); {fix}") from exc
    if not isinstance(data, dict):
        raise DamagedFileError(f"{path} is not a JSON object; {fix}")
    return data


def move_aside(path: str | os.PathLike) -> Path:
    """Move a damaged file to ``<path>.damaged`` (replacing an older one) and return that path;
    another process that moved it first is no error."""
    path = Path(path)
    aside = path.with_name(path.name + DAMAGED)
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        pass
    return aside


def sweep_fix(run_dir: str | os.PathLike, manifest: dict | None = None, does: str = "probes it again") -> str:
    """What writes a run's checkpoint files (and manifest, integrity.json) again: the sweep
    command in its manifest, else the sweep that wrote it; a live run re-probes when resumed."""
    command = (manifest or {}).get("command")
    if isinstance(command, str) and command.startswith(("peakprobe sweep", "peakprobe run")):
        return f"`{_with_out(command, run_dir)}` {does}"
    if manifest and str(manifest.get("source")) == str(Path(run_dir).resolve()):  # a live run
        return ("a resumed training run moves it aside and re-probes the steps it reaches; "
                "delete it to fit without that step")
    return f"re-running the sweep that wrote {run_dir} (same options, same --out) {does}"


def _with_out(command: str, run_dir: str | os.PathLike) -> str:
    """``command`` with its ``--out`` naming ``run_dir`` (a run directory copied elsewhere)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    for i, word in enumerate(words):
        if word == "--out" and i + 1 < len(words):
            words[i + 1] = str(run_dir)
        elif word.startswith("--out="):
            words[i] = f"--out={run_dir}"
    return shlex.join(words)


def fit_fix(run_dir: str | os.PathLike) -> str:
    return f"`peakprobe fit {run_dir}` writes it again"


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
    failed and later succeeded on resume is not a failure). A line that does not parse (a log
    cut short) is passed over."""
    path = Path(run_dir) / FAILURES
    if not path.exists():
        return []
    latest: dict[str, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
        if isinstance(record, dict):
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
    manifest = _manifest_or_none(run_dir)
    return read_json_object(path, sweep_fix(run_dir, manifest, "writes it again"))


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
    fix = (f"re-running the sweep that wrote {run_dir} (same options, same --out) writes it "
           "again (a live run: resuming the training run)")
    return read_json_object(path, fix)


def _manifest_or_none(run_dir: str | os.PathLike) -> dict | None:
    try:
        return read_manifest(run_dir)
    except RunDirError:
        return None



#: the manifest entries that must match for results to be mixed in one run directory
IDENTITY_KEYS: tuple[str, ...] = ("format", "model", "source", "checkpoints", "data", "probe",
                                  "attribution", "load")


def run_identity(manifest: dict, keys: tuple[str, ...] = IDENTITY_KEYS) -> dict:
    """What of a manifest makes a run: two manifests with equal identities may share a run
    directory (a sweep resumes into it, a live run continues it)."""
    return {k: manifest.get(k) for k in keys}


def checkpoint_problem(path: str | os.PathLike, manifest: dict | None = None) -> str | None:
    """Why a checkpoint file does not read back as this run's results, or None when it does:
    empty, not parquet (truncated), another schema, no rows, or another run's model, revision
    or step (``manifest``'s, when given)."""
    try:
        table = _read_table(Path(path))
    except DamagedFileError as exc:
        return str(exc)
    return _identity_problem(Path(path), table, manifest)


def _read_table(path: Path) -> pa.Table:
    """The file's table in the results schema, or a :class:`DamagedFileError` saying why not."""
    try:
        if path.stat().st_size == 0:
            raise DamagedFileError("is empty (0 bytes)")
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DamagedFileError(f"is not a readable parquet file ({_why(exc)})") from exc
    fields = {f.name: f.type for f in table.schema}
    off = [n for n, t in zip(RESULT_SCHEMA.names, RESULT_SCHEMA.types, strict=True)
           if not _same_type(fields.get(n), t)] or sorted(set(fields) - set(RESULT_SCHEMA.names))
    if off:
        raise DamagedFileError(f"does not have the results schema (columns {', '.join(off)})")
    table = table.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
    if table.num_rows == 0:
        raise DamagedFileError("holds no rows")
    return table


def _same_type(found: pa.DataType | None, want: pa.DataType) -> bool:
    """Equal types, counting pandas' large strings as strings (a file rewritten by pandas)."""
    if found is None:
        return False
    strings = (pa.types.is_string, pa.types.is_large_string)
    return found == want or any(f(found) for f in strings) and pa.types.is_string(want)


def _identity_problem(path: Path, table: pa.Table, manifest: dict | None) -> str | None:
    safe = path.name.removesuffix(".parquet")
    revisions = set(table.column("revision").to_pylist())
    if {str(r).replace("/", "__") for r in revisions} != {safe}:
        return f"holds revision {short(revisions)}, not {safe.replace('__', '/')}"
    revision = revisions.pop()
    if manifest is None:
        return None
    models = set(table.column("model").to_pylist())
    if models != {manifest.get("model")}:
        return f"holds model {short(models)}, not this run's {manifest.get('model')}"
    steps = {c.get("revision"): c.get("step") for c in manifest.get("checkpoints") or []
             if isinstance(c, dict)}
    found = set(table.column("step").to_pylist())
    if revision in steps and found != {steps[revision]}:
        return f"holds step {short(found)}, not this run's {steps[revision]}"
    return None


def short(values: set) -> str:
    return ", ".join(sorted(map(str, values))[:3]) or "none"


def read_checkpoint(path: str | os.PathLike, manifest: dict | None = None,
                    fix: str | None = None) -> pd.DataFrame:
    """One checkpoint file as a tidy frame; a one-line :class:`DamagedFileError` naming it (and
    ``fix``, what writes it again) when it does not read back as this run's results."""
    path = Path(path)
    try:
        table = _read_table(path)
    except DamagedFileError as exc:
        problem = str(exc)
    else:
        problem = _identity_problem(path, table, manifest)
        if problem is None:
            return table.to_pandas()
    raise DamagedFileError(f"{path} {problem}" + (f"; {fix}" if fix else ""))


def read_results(run_dir: str | os.PathLike) -> pd.DataFrame:
    """All finished checkpoints of a run as one tidy frame, ordered by step then site; a one-line
    :class:`DamagedFileError` for a checkpoint file that does not read back."""
    files = sorted((Path(run_dir) / CHECKPOINTS).glob("*.parquet"))
    if not files:
        raise RunDirError(f"{run_dir} has no finished checkpoints (nothing in {CHECKPOINTS}/)")
    manifest = _manifest_or_none(run_dir) if (Path(run_dir) / MANIFEST).exists() else None
    fix = sweep_fix(run_dir, manifest)
    df = pd.concat([read_checkpoint(f, manifest, fix) for f in files], ignore_index=True)
    return df.sort_values(["step", *SORT_KEYS], kind="stable").reset_index(drop=True)


def read_fits(run_dir: str | os.PathLike) -> pd.DataFrame:
    """``fits.parquet``; a one-line :class:`DamagedFileError` when it does not read back."""
    path = Path(run_dir) / FITS
    try:
        if path.stat().st_size == 0:
            raise DamagedFileError(f"{path} is empty (0 bytes); {fit_fix(run_dir)}")
        return pq.read_table(path).to_pandas()
    except (OSError, pa.ArrowException) as exc:
        raise DamagedFileError(f"{path} is not a readable parquet file ({_why(exc)}); "
                               f"{fit_fix(run_dir)}") from exc


def read_fits_json(run_dir: str | os.PathLike) -> dict:
    """``fits.json``; a one-line :class:`DamagedFileError` when it does not read back."""
    return read_json_object(Path(run_dir) / FITS_JSON, fit_fix(run_dir))
