"""The loop over checkpoints: load each one, probe it on the evaluation tokens, write its results.

Each checkpoint's tidy results land in ``RUN/checkpoints/<revision>.parquet`` atomically, so an
interrupted sweep loses at most the checkpoint in flight and a re-run with the same manifest
skips what is done. A checkpoint that fails to load or run goes to ``failures.jsonl`` and the
sweep moves on. The next checkpoint loads in a background thread while the current one runs.
Several processes (``accelerate launch -m peakprobe sweep ...``, or ``--processes N``) split
the checkpoint list between them and write disjoint files, so their union equals a
one-process run.
"""

from __future__ import annotations

import gc
import os
import shutil
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from . import results
from .checkpoints_index import Checkpoint, CheckpointSequence
from .data import EvalData
from .hooks import ProbeConfig, UnsupportedModelError, attach
from .version import __version__

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SweepError(ValueError):
    """A sweep cannot start: a changed configuration, pickle weights, a bad option."""


@dataclass
class SweepConfig:
    """How checkpoints are loaded and run.

    dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``float64`` or ``auto`` for
    the checkpoint's own). device: ``auto`` (the process's accelerator if any, else CPU),
    ``cpu`` or ``cuda[:i]``. device_map: ``auto`` spreads large checkpoints over the available
    devices (accelerate). allow_pickle: accept ``pytorch_model.bin`` weights (they can run code).
    """

    batch_size: int = 8
    dtype: str = "float32"
    device: str = "auto"
    device_map: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    prefetch: bool = True
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise SweepError(f"unknown dtype {self.dtype!r}; use one of auto, {', '.join(DTYPES)}")
        if self.batch_size < 1:
            raise SweepError(f"batch size must be >= 1, got {self.batch_size}")


@dataclass
class SweepSummary:
    run_dir: Path
    done: list[str]
    skipped: list[str]
    failed: list[str]


@contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """Silence transformers' own loading/saving progress bars (ours show the work), then restore."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def load_model(seq: CheckpointSequence, ckpt: Checkpoint, config: SweepConfig, device: str):
    """Load one checkpoint: a local folder, or a hub revision (``seq.source`` at ``revision``)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"trust_remote_code": config.trust_remote_code}
    kwargs["dtype"] = "auto" if config.dtype == "auto" else DTYPES[config.dtype]
    if ckpt.path is not None:
        folder = Path(ckpt.path)
        if not _has_safetensors(folder):
            if not config.allow_pickle:
                raise SweepError(
                    f"{folder} has no .safetensors weights; pickle weights can run code when "
                    "loaded: pass --allow-pickle only if you trust them"
                )
            kwargs["use_safetensors"] = False
        else:
            kwargs["use_safetensors"] = True
        source, revision = str(folder), None
    else:
        source, revision = seq.source, ckpt.revision
        kwargs["use_safetensors"] = None if config.allow_pickle else True
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    with quiet_transformers_progress():
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, **kwargs)
    if config.device_map is None:
        model = model.to(device)
    return model.eval()


def _identity(manifest: dict) -> dict:
    """The parts of a manifest that must match for results to be mixed in one run."""
    return {k: manifest.get(k) for k in ("format", "model", "source", "checkpoints", "data", "probe", "load")}


def build_manifest(seq: CheckpointSequence, data: EvalData, config: SweepConfig, command: str | None) -> dict:
    import transformers

    return {
        "format": results.FORMAT,
        "model": seq.name,
        "source": seq.source,
        "family": seq.family,
        "schedule": None if seq.schedule is None else seq.schedule.to_json(),
        "checkpoints": [c.to_dict() for c in seq],
        "data": data.describe(),
        "probe": config.probe.describe(),
        "load": {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code},
        "versions": {
            "peakprobe": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": command,
    }


def prepare_run_dir(run_dir: Path, manifest: dict, *, force: bool) -> None:
    """Create the run directory, or check that an existing one was made with the same inputs."""
    path = run_dir / results.MANIFEST
    if path.exists() and not force:
        old = results.read_json(path)
        if _identity(old) != _identity(manifest):
            changed = [k for k, v in _identity(manifest).items() if _identity(old).get(k) != v]
            raise SweepError(
                f"{run_dir} holds results of a different sweep ({', '.join(changed)} changed); "
                "use another --out, or --force to start over"
            )
        return
    if force and run_dir.exists():
        for name in (results.CHECKPOINTS, results.REPORT):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        for name in (results.FAILURES, results.FITS, results.FITS_JSON):
            (run_dir / name).unlink(missing_ok=True)
    (run_dir / results.CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    results.write_json(path, manifest)


def probe_model(model, data: EvalData, config: SweepConfig, *, progress: bool = False, desc: str = "") -> pd.DataFrame:
    """Per-site statistics of one loaded model over all evaluation windows (tidy frame)."""
    n_batches = -(-data.n_windows // config.batch_size)
    with attach(model, config.probe) as probe:
        for ids, mask in tqdm(
            data.batches(config.batch_size), total=n_batches, desc=desc, leave=False,
            disable=not progress, unit="batch",
        ):
            probe.run_batch(ids, mask)
        return probe.to_frame()


def _tidy(frame: pd.DataFrame, seq: CheckpointSequence, ckpt: Checkpoint) -> pd.DataFrame:
    frame = frame.copy()
    frame.insert(0, "model", seq.name)
    frame.insert(1, "revision", ckpt.revision)
    frame.insert(2, "step", int(ckpt.step))
    frame.insert(3, "tokens", -1 if ckpt.tokens is None else int(ckpt.tokens))
    frame.insert(4, "tau", float("nan") if ckpt.tau is None else float(ckpt.tau))
    return frame


def tidy_frame(frame: pd.DataFrame, seq: CheckpointSequence, ckpt: Checkpoint) -> pd.DataFrame:
    """``probe_model``'s frame with the checkpoint's columns in front: what a parquet holds.

    Public so that live probing (peakprobe.integrations) writes exactly what the sweep writes."""
    return _tidy(frame, seq, ckpt)


def shard_info() -> tuple[int, int, str]:
    """(rank, world size, device) of this process: accelerate's view when launched by it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ:
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())  # cpu=True: gloo over processes
        return state.process_index, state.num_processes, str(state.device)
    return 0, 1, "cuda" if torch.cuda.is_available() else "cpu"


def _loader(seq, todo, config, device) -> Iterator[tuple[Checkpoint, object]]:
    """Yield (checkpoint, model or exception), loading the next one in a background thread."""
    if not todo:
        return
    pool = ThreadPoolExecutor(max_workers=1) if config.prefetch else None

    def load(c):
        try:
            return load_model(seq, c, config, device)
        except Exception as exc:  # reported per checkpoint, never fatal
            return exc

    try:
        pending: Future | None = pool.submit(load, todo[0]) if pool else None
        for i, ckpt in enumerate(todo):
            model = pending.result() if pool else load(ckpt)
            pending = pool.submit(load, todo[i + 1]) if pool and i + 1 < len(todo) else None
            yield ckpt, model
            del model
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)


def sweep(
    seq: CheckpointSequence,
    data: EvalData,
    run_dir: str | os.PathLike,
    config: SweepConfig | None = None,
    *,
    force: bool = False,
    rank: int | None = None,
    world: int | None = None,
    progress: bool = True,
    command: str | None = None,
) -> SweepSummary:
    """Probe every checkpoint of ``seq`` on ``data`` and write the run directory ``run_dir``."""
    config = config or SweepConfig()
    run_dir = Path(run_dir)
    if len(seq) == 0:
        raise SweepError("no checkpoints selected")
    auto_rank, auto_world, auto_device = shard_info()
    rank = auto_rank if rank is None else rank
    world = auto_world if world is None else world
    device = auto_device if config.device == "auto" else config.device
    manifest = build_manifest(seq, data, config, command)
    if rank == 0:
        prepare_run_dir(run_dir, manifest, force=force)
    if auto_world > 1:  # launched by accelerate: the others wait for rank 0's directory
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()
    if rank != 0:
        prepare_run_dir(run_dir, manifest, force=False)

    mine = [c for i, c in enumerate(seq) if i % world == rank]
    skipped = [c.revision for c in mine if results.checkpoint_path(run_dir, c.revision).exists()]
    todo = [c for c in mine if c.revision not in set(skipped)]
    done, failed = [], []
    bar = tqdm(total=len(mine), initial=len(skipped), desc=f"{seq.name} checkpoints",
               disable=not progress, unit="ckpt", position=0)
    for ckpt, model in _loader(seq, todo, config, device):
        bar.set_postfix_str(ckpt.revision)
        try:
            if isinstance(model, Exception):
                raise model
            frame = probe_model(model, data, config, progress=progress, desc=ckpt.revision)
            results.write_checkpoint(run_dir, ckpt.revision, _tidy(frame, seq, ckpt))
            done.append(ckpt.revision)
        except UnsupportedModelError:
            raise  # every checkpoint of the family would fail the same way
        except Exception as exc:
            results.append_failure(run_dir, {
                "revision": ckpt.revision,
                "step": ckpt.step,
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "traceback": traceback.format_exc(limit=5),
            })
            failed.append(ckpt.revision)
        finally:
            model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        bar.update(1)
    bar.close()
    return SweepSummary(run_dir, done, skipped, failed)
