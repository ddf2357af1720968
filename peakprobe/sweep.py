"""The loop over checkpoints: load each one, probe it on the evaluation tokens, write its results.

Each checkpoint's tidy results land in ``RUN/checkpoints/<revision>.parquet`` atomically, so an
interrupted sweep loses at most the checkpoint in flight and a re-run with the same manifest
skips what is done. A checkpoint that fails to load or run goes to ``failures.jsonl`` and the
sweep moves on. The next checkpoint loads in a background thread while the current one runs.

Scale-out lives here only: ``processes=N`` fans the checkpoints out over N local processes;
under ``accelerate launch`` / ``torchrun`` each rank takes its share; ``shard=(K, N)`` (CLI
``--shard K/N``) takes every N-th checkpoint from the K-th, so Slurm / PBS job arrays split a
sweep with no launcher. Every checkpoint is probed under a lock file (``RUN/locks/``), so two
sweeps on one run directory never probe the same checkpoint; the union of any split equals a
one-process run. Before probing, ``integrity.json`` records checkpoints whose weight files
duplicate another's; ``prune_cache`` deletes each hub revision this sweep downloaded from the
HF cache once its results are written. :func:`load_tokenizer` is the one tokenizer loader.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from . import results
from .checkpoints_index import Checkpoint, CheckpointSequence
from .checkpoints_index.cache import cached_refs, delete_cached_revisions, hub_cache_dir
from .checkpoints_index.integrity import integrity_record
from .config import ConfigError, ProbeConfig, SweepConfig
from .data import DataError, EvalData
from .hf import quiet_transformers_progress
from .hooks import CompileError, UnsupportedModelError, attach
from .hooks.attribution import attribute
from .hooks.search import describe_attribution
from .version import __version__

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SweepError(ConfigError):
    """A sweep cannot start: a changed configuration, pickle weights, a bad option."""


@dataclass
class SweepSummary:
    """What one sweep did: probed (done), already there (skipped), failed, held by another
    process (busy), and deleted from the HF cache (pruned)."""

    run_dir: Path
    done: list[str]
    skipped: list[str]
    failed: list[str]
    busy: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def load_model(source: str, revision: str | None, config: SweepConfig, device: str):
    """Load one checkpoint: a local folder (``revision`` ignored), or hub ``source`` at ``revision``."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"trust_remote_code": config.trust_remote_code}
    kwargs["dtype"] = "auto" if config.dtype == "auto" else DTYPES[config.dtype]
    folder = Path(source).expanduser()
    if folder.is_dir():
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
        kwargs["use_safetensors"] = None if config.allow_pickle else True
        kwargs.update(cache_dir=str(hub_cache_dir()), local_files_only=config.local_files_only)
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    with quiet_transformers_progress():
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, **kwargs)
    if config.device_map is None:
        model = model.to(device)
    return model.eval()


def load_config(source: str, revision: str | None, config: SweepConfig):
    """The model config of one checkpoint (a small file, read before any weights), from the same
    place ``load_model`` would load it; a one-line DataError when it cannot be read."""
    from transformers import AutoConfig

    kwargs: dict = {"trust_remote_code": config.trust_remote_code}
    folder = Path(source).expanduser()
    if folder.is_dir():
        source, revision = str(folder), None
    else:
        kwargs.update(cache_dir=str(hub_cache_dir()), local_files_only=config.local_files_only)
    try:
        return AutoConfig.from_pretrained(source, revision=revision, **kwargs)
    except Exception as exc:  # OSError, hub errors: one line
        at = f"{source}@{revision}" if revision else source
        raise DataError(f"cannot read the model config of {at} ({type(exc).__name__})") from exc


def load_tokenizer(
    where: str | os.PathLike | CheckpointSequence,
    tokenizer: str | None = None,
    *,
    local_files_only: bool = False,
):
    """The one tokenizer loader: ``tokenizer`` (a folder or hub id) when given; else the one
    saved with ``where`` (a folder), or, for a checkpoint sequence, with its first checkpoint
    (folder or hub revision), then with the repo's ``main``. Never requires ``main``.

    Raises :class:`DataError` (one line) when none loads."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        tries = [(str(tokenizer), None)]
    elif isinstance(where, CheckpointSequence):
        first = where[0]
        tries = [(first.path, None)] if first.path else [(where.source, first.revision), (where.source, "main")]
    else:
        tries = [(str(where), None)]
    hub = {} if Path(tries[0][0]).expanduser().is_dir() else {
        "cache_dir": str(hub_cache_dir()), "local_files_only": local_files_only}
    errors = []
    for source, revision in dict.fromkeys(tries):
        try:
            with quiet_transformers_progress():
                return AutoTokenizer.from_pretrained(source, revision=revision, **hub)
        except Exception as exc:  # OSError, ValueError, hub errors: try the next, then one line
            errors.append(f"{source}{'@' + revision if revision else ''} ({type(exc).__name__})")
    raise DataError(
        f"cannot load a tokenizer from {', '.join(errors)}; pass --tokenizer PATH to a local "
        "tokenizer folder"
    )


def _identity(manifest: dict) -> dict:
    """The parts of a manifest that must match for results to be mixed in one run."""
    return {k: manifest.get(k) for k in ("format", "model", "source", "checkpoints", "data", "probe", "load")}


def _describe_probe(probe: ProbeConfig) -> dict:
    """The manifest's probe entry, with the attribution method spelled out."""
    out = probe.describe()
    if probe.attribution:
        out["attribution"] = describe_attribution(probe.attribution_windows, probe.attribution_heads)
    return out


def build_manifest(seq: CheckpointSequence, data: EvalData, config: SweepConfig, command: str | None) -> dict:
    import transformers

    return {
        "format": results.FORMAT,
        "model": seq.name,
        "source": seq.source,
        "family": seq.family,
        "fit_start_step": seq.fit_start_step,
        "schedule": None if seq.schedule is None else seq.schedule.to_json(),
        "checkpoints": [c.to_dict() for c in seq],
        "data": data.describe(),
        "probe": _describe_probe(config.probe),
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
        for name in (results.FAILURES, results.FITS, results.FITS_JSON, results.INTEGRITY):
            (run_dir / name).unlink(missing_ok=True)
    (run_dir / results.CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    results.write_json(path, manifest)


def probe_model(model, data: EvalData, config: SweepConfig, *, progress: bool = False, desc: str = "") -> pd.DataFrame:
    """Per-site statistics of one loaded model over all evaluation windows (tidy frame), plus the
    attribution metrics (sensitivity, curvature, gain, log_beta_opt) over the first
    ``config.probe.attribution_windows`` windows when ``config.probe.attribution``."""
    n_batches = -(-data.n_windows // config.batch_size)
    with attach(model, config.probe) as probe:
        for ids, mask in tqdm(
            data.batches(config.batch_size), total=n_batches, desc=desc, leave=False,
            disable=not progress, unit="batch",
        ):
            probe.run_batch(ids, mask)
        frame = probe.to_frame()
    if not config.probe.attribution:
        return frame
    n = min(config.probe.attribution_windows, data.n_windows)
    ids, mask, bs = data.input_ids[:n], data.attention_mask[:n], config.batch_size
    subset = [(ids[i : i + bs], mask[i : i + bs]) for i in range(0, n, bs)]  # (b, T) each
    extra = attribute(model, subset, heads=config.probe.attribution_heads, progress=progress,
                      desc=f"{desc} attribution".strip())
    frame = pd.concat([frame, extra], ignore_index=True)
    return frame.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(drop=True)


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


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 0 <= K < N; a one-line :class:`SweepError` otherwise."""
    k, sep, n = str(text).partition("/")
    try:
        shard = (int(k), int(n))
    except ValueError:
        shard = None
    if not sep or shard is None or not 0 <= shard[0] < shard[1]:
        raise SweepError(f"--shard must be K/N with 0 <= K < N (e.g. 0/4 ... 3/4), got {text!r}")
    return shard


def _lock(run_dir: Path, revision: str) -> FileLock:
    path = run_dir / results.LOCKS / (revision.replace("/", "__") + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path, thread_local=False)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _source(seq: CheckpointSequence, ckpt: Checkpoint) -> tuple[str, str | None]:
    return (ckpt.path, None) if ckpt.path is not None else (seq.source, ckpt.revision)


def _claim(run_dir: Path, ckpt: Checkpoint) -> FileLock | None:
    """This checkpoint's lock, held, when no other process holds it and it is not done yet."""
    lock = _lock(run_dir, ckpt.revision)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    if results.checkpoint_path(run_dir, ckpt.revision).exists():  # finished by another process
        lock.release()
        return None
    return lock


def _loader(seq, todo, config, device, run_dir) -> Iterator[tuple[Checkpoint, FileLock | None, list]]:
    """Yield (checkpoint, its lock or None when another process has it, [model or exception]),
    loading the next claimed checkpoint in a background thread.

    The model travels in a one-item list that the consumer empties, so this generator holds no
    reference to it while the consumer frees memory."""
    pool = ThreadPoolExecutor(max_workers=1) if config.prefetch else None

    def load(c):
        try:
            return load_model(*_source(seq, c), config, device)
        except Exception as exc:  # reported per checkpoint, never fatal
            return exc

    busy: list[Checkpoint] = []
    held: list[FileLock] = []  # claimed, not yet handed to the consumer

    def claim_next(i):
        while i < len(todo):
            lock = _claim(run_dir, todo[i])
            if lock is not None:
                held.append(lock)
                return i, lock, (pool.submit(load, todo[i]) if pool else None)
            busy.append(todo[i])
            i += 1
        return i, None, None

    try:
        i, lock, pending = claim_next(0)
        while True:
            for ckpt in busy:
                yield ckpt, None, []
            busy.clear()
            if i >= len(todo):
                return
            ckpt = todo[i]
            box = [pending.result() if pool else load(ckpt)]
            pending = None  # a finished Future keeps its result
            held.remove(lock)
            i, next_lock, pending = claim_next(i + 1)
            yield ckpt, lock, box
            lock = next_lock
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)
        for lock in held:  # the consumer stopped early: free what it never got
            lock.release()


def _sweep_worker(payload: dict, rank: int, world: int) -> SweepSummary:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    show = payload.pop("progress") and rank == 0
    return sweep(rank=rank, world=world, progress=show, integrity=False, **payload)


def _fan_out(payload: dict, processes: int) -> SweepSummary:
    """Run ``sweep`` in ``processes`` spawned local processes (one GPU each when there are GPUs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        futures = [pool.submit(_sweep_worker, dict(payload), r, processes) for r in range(processes)]
        parts = [f.result() for f in futures]
    return SweepSummary(
        payload["run_dir"], *([r for p in parts for r in getattr(p, name)]
                              for name in ("done", "skipped", "failed", "busy", "pruned"))
    )


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"peakprobe: {text}", file=sys.stderr)


def sweep(
    seq: CheckpointSequence,
    data: EvalData,
    run_dir: str | os.PathLike,
    config: SweepConfig | None = None,
    *,
    force: bool = False,
    processes: int = 1,
    shard: tuple[int, int] | None = None,
    prune_cache: bool = False,
    rank: int | None = None,
    world: int | None = None,
    integrity: bool = True,
    progress: bool = True,
    command: str | None = None,
) -> SweepSummary:
    """Probe every checkpoint of ``seq`` on ``data`` and write the run directory ``run_dir``.

    ``shard=(K, N)`` probes checkpoints K, K+N, K+2N, ... of ``seq`` only (the manifest still
    lists all of them); ``processes`` and launcher ranks split that share further.
    ``prune_cache`` deletes each hub revision that was not in the HF cache when this sweep
    started from the cache once its results are written."""
    config = config or SweepConfig()
    run_dir = Path(run_dir)
    if len(seq) == 0:
        raise SweepError("no checkpoints selected")
    if shard is not None and force:
        raise SweepError("--force with --shard would discard the other shards' results; "
                         "remove the run directory first instead")
    auto_rank, auto_world, auto_device = shard_info()
    rank = auto_rank if rank is None else rank
    world = auto_world if world is None else world
    device = auto_device if config.device == "auto" else config.device
    manifest = build_manifest(seq, data, config, command)
    if rank == 0:
        prepare_run_dir(run_dir, manifest, force=force)
        if integrity and not (run_dir / results.INTEGRITY).exists():
            results.write_integrity(run_dir, integrity_record(seq, offline=config.local_files_only))
    if processes > 1:
        payload = dict(seq=seq, data=data, run_dir=run_dir, config=config, shard=shard,
                       prune_cache=prune_cache, progress=progress, command=command)
        return _fan_out(payload, processes)
    if auto_world > 1:  # launched by accelerate: the others wait for rank 0's directory
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()
    if rank != 0:
        prepare_run_dir(run_dir, manifest, force=False)

    share = [c for i, c in enumerate(seq) if shard is None or i % shard[1] == shard[0]]
    mine = [c for i, c in enumerate(share) if i % world == rank]
    skipped = [c.revision for c in mine if results.checkpoint_path(run_dir, c.revision).exists()]
    todo = [c for c in mine if c.revision not in set(skipped)]
    hub = any(c.path is None for c in seq)
    cached_before = set(cached_refs(seq.source)) if prune_cache and hub else set()
    summary = SweepSummary(run_dir, [], skipped, [])
    bar = tqdm(total=len(mine), initial=len(skipped), desc=f"{seq.name} checkpoints",
               disable=not progress, unit="ckpt", position=0)
    for ckpt, lock, box in _loader(seq, todo, config, device, run_dir):
        if lock is None:  # another process on this run directory has it, or has finished it
            (summary.skipped if results.checkpoint_path(run_dir, ckpt.revision).exists()
             else summary.busy).append(ckpt.revision)
            bar.update(1)
            continue
        bar.set_postfix_str(ckpt.revision)
        model = box.pop()
        try:
            if isinstance(model, Exception):
                raise model
            frame = probe_model(model, data, config, progress=progress, desc=ckpt.revision)
            results.write_checkpoint(run_dir, ckpt.revision, _tidy(frame, seq, ckpt))
            summary.done.append(ckpt.revision)
        except (UnsupportedModelError, CompileError):
            raise  # every checkpoint of the family would fail the same way
        except Exception as exc:
            results.append_failure(run_dir, {
                "revision": ckpt.revision,
                "step": ckpt.step,
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "traceback": traceback.format_exc(limit=5),
            })
            summary.failed.append(ckpt.revision)
        finally:
            del model  # the last reference: the loader keeps none (see _loader)
            _free_memory()
            lock.release()
        if prune_cache and ckpt.path is None and ckpt.revision not in cached_before \
                and ckpt.revision in summary.done:
            summary.pruned += delete_cached_revisions(seq.source, [ckpt.revision])
        bar.update(1)
    bar.close()
    if summary.busy:
        _say(progress, f"{len(summary.busy)} checkpoints are being probed by another process "
                       f"on {run_dir} ({', '.join(summary.busy[:4])}); re-run later to pick up any it leaves")
    return summary
