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
import time
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from . import results
from .attribution import describe_attribution
from .checkpoint import CheckpointError, load_model, probe_model, tidy_frame
from .checkpoints_index import Checkpoint, CheckpointSequence
from .checkpoints_index.cache import cached_refs, delete_cached_revisions
from .checkpoints_index.hub import is_network_error
from .checkpoints_index.integrity import integrity_record
from .config import ConfigError, SweepConfig
from .data import EvalData
from .formatting import short_list
from .hooks import UnsupportedModelError
from .version import __version__
from .vocab import PeakprobeWarning


class SweepError(ConfigError):
    """A sweep cannot start: a changed configuration, pickle weights, a bad option."""


class DamagedFileWarning(PeakprobeWarning):
    """A run-directory file did not read back and was moved aside to ``<file>.damaged``."""


def move_aside(path: Path, problem: str, then: str) -> None:
    """Move a damaged run-directory file aside and say so in one line (a warning)."""
    aside = results.move_aside(path)
    warnings.warn(f"{path} {problem}: moved aside to {aside.name}; {then}", DamagedFileWarning,
                  stacklevel=3)


@dataclass
class SweepOutcome:
    """What one sweep did: probed (done), already there (skipped), failed, held by another
    process (busy), and deleted from the HF cache (pruned)."""

    run_dir: Path
    done: list[str]
    skipped: list[str]
    failed: list[str]
    busy: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)


def _describe_attribution(config: SweepConfig) -> dict | None:
    """The manifest's attribution entry: the method spelled out, or None when it is off."""
    a = config.attribution
    return describe_attribution(a.windows, a.heads) if a.active else None


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
        "probe": config.probe.describe(),
        "attribution": _describe_attribution(config),
        "load": {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code},
        "versions": {
            "peakprobe": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": command,
    }


def prepare_run_dir(run_dir: Path, manifest: dict, *, force: bool) -> None:
    """Create the run directory, or check that an existing one was made with the same inputs.
    A manifest that does not read back is moved aside and written again."""
    path = run_dir / results.MANIFEST
    if path.exists() and not force:
        try:
            old = results.run_identity(results.read_manifest(run_dir))
        except results.DamagedFileError:
            move_aside(path, "does not read back", "writing it again")
        else:
            new = results.run_identity(manifest)
            if old != new:
                changed = [k for k, v in new.items() if old.get(k) != v]
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


def heal(run_dir: Path, ckpts: list[Checkpoint], manifest: dict) -> list[str]:
    """Move aside each of ``ckpts``' result files that does not read back as this run's (one
    line each): they are probed again, never counted as done. Returns their revisions."""
    healed = []
    for c in ckpts:
        path = results.checkpoint_path(run_dir, c.revision)
        problem = results.checkpoint_problem(path, manifest) if path.exists() else None
        if problem is not None:
            move_aside(path, problem, "probing it again")
            healed.append(c.revision)
    return healed


def _write_integrity(run_dir: Path, seq: CheckpointSequence, offline: bool) -> None:
    """Write integrity.json unless a readable one is there (a damaged one is moved aside)."""
    path = run_dir / results.INTEGRITY
    if path.exists():
        try:
            results.read_integrity_record(run_dir)
            return
        except results.DamagedFileError:
            move_aside(path, "does not read back", "writing it again")
    results.write_integrity(run_dir, integrity_record(seq, offline=offline))


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



def check_shard(shard: tuple[int, int] | str | None, force: bool) -> tuple[int, int] | None:
    """The shard as (K, N) (``"K/N"`` parsed), checked against ``force``: the one place that
    refuses --force with --shard (it would discard the other shards' results)."""
    if isinstance(shard, str):
        shard = parse_shard(shard)
    if shard is not None and force:
        raise SweepError("--force with --shard would discard the other shards' results; "
                         "remove the run directory first instead")
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


#: a hub checkpoint whose download breaks off (a reset connection, a 5xx answer) is loaded again
#: up to this many times in all; huggingface_hub resumes the files it has
LOAD_TRIES = 3
RETRY_SECONDS = 1.0


def is_transient(exc: BaseException) -> bool:
    """Whether a failed load is worth trying again: a network error or a 429/5xx answer."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(getattr(current, "response", None), "status_code", None)
        if is_network_error(current) or status in (429, 500, 502, 503, 504):
            return True
        current = current.__cause__ or current.__context__
    return False


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
        for attempt in range(LOAD_TRIES):
            try:
                return load_model(*_source(seq, c), config, device)
            except Exception as exc:  # reported per checkpoint, never fatal
                if c.path is not None or attempt + 1 == LOAD_TRIES or not is_transient(exc):
                    return exc
                time.sleep(RETRY_SECONDS * 2**attempt)

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


def _sweep_worker(payload: dict, rank: int, world: int) -> SweepOutcome:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    show = payload.pop("progress") and rank == 0
    return sweep(rank=rank, world=world, progress=show, integrity=False, **payload)


def _fan_out(payload: dict, processes: int) -> SweepOutcome:
    """Run ``sweep`` in ``processes`` spawned local processes (one GPU each when there are GPUs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        futures = [pool.submit(_sweep_worker, dict(payload), r, processes) for r in range(processes)]
        parts = [f.result() for f in futures]
    return SweepOutcome(
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
    shard: tuple[int, int] | str | None = None,
    prune_cache: bool = False,
    rank: int | None = None,
    world: int | None = None,
    integrity: bool = True,
    progress: bool = True,
    command: str | None = None,
) -> SweepOutcome:
    """Probe every checkpoint of ``seq`` on ``data`` and write the run directory ``run_dir``.

    ``shard=(K, N)`` (or ``"K/N"``) probes checkpoints K, K+N, K+2N, ... of ``seq`` only (the
    manifest still lists all of them); ``processes`` and launcher ranks split that share
    further. ``prune_cache`` deletes each hub revision that was not in the HF cache when this
    sweep started from the cache once its results are written."""
    config = config or SweepConfig()
    run_dir = Path(run_dir)
    if len(seq) == 0:
        raise SweepError("no checkpoints selected")
    shard = check_shard(shard, force)
    auto_rank, auto_world, auto_device = shard_info()
    rank = auto_rank if rank is None else rank
    world = auto_world if world is None else world
    manifest = build_manifest(seq, data, config, command)
    share = [c for i, c in enumerate(seq) if shard is None or i % shard[1] == shard[0]]
    if rank == 0:
        prepare_run_dir(run_dir, manifest, force=force)
        if integrity:
            _write_integrity(run_dir, seq, config.local_files_only)
        heal(run_dir, share, manifest)
    if processes > 1:
        payload = dict(seq=seq, data=data, run_dir=run_dir, config=config, shard=shard,
                       prune_cache=prune_cache, progress=progress, command=command)
        return _fan_out(payload, processes)
    if auto_world > 1:  # launched by accelerate: the others wait for rank 0's directory
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()
    if rank != 0:
        prepare_run_dir(run_dir, manifest, force=False)
    device = auto_device if config.device == "auto" else config.device
    return _probe_share(seq, share[rank::world], data, run_dir, config, device,
                        prune_cache=prune_cache, progress=progress)


def _probe_share(seq: CheckpointSequence, mine: list[Checkpoint], data: EvalData, run_dir: Path,
                 config: SweepConfig, device: str, *, prune_cache: bool, progress: bool
                 ) -> SweepOutcome:
    """Probe this process's checkpoints ``mine`` (those not done yet, each under its lock)."""
    skipped = [c.revision for c in mine if results.checkpoint_path(run_dir, c.revision).exists()]
    todo = [c for c in mine if c.revision not in set(skipped)]
    hub = any(c.path is None for c in seq)
    cached_before = set(cached_refs(seq.source)) if prune_cache and hub else set()
    summary = SweepOutcome(run_dir, [], skipped, [])
    refused: list[CheckpointError] = []  # checkpoints peakprobe must not or cannot probe
    bar = tqdm(total=len(mine), initial=len(skipped), desc=f"{seq.name} checkpoints",
               disable=not progress, unit="ckpt", position=0)
    for ckpt, lock, box in _loader(seq, todo, config, device, run_dir):
        if lock is None:  # another process on this run directory has it, or has finished it
            (summary.skipped if results.checkpoint_path(run_dir, ckpt.revision).exists()
             else summary.busy).append(ckpt.revision)
        else:
            bar.set_postfix_str(ckpt.revision)
            error = _probe_one(seq, ckpt, box, lock, data, run_dir, config, progress)
            (summary.failed if error else summary.done).append(ckpt.revision)
            refused += [error] if isinstance(error, CheckpointError) else []
            if prune_cache and not error and ckpt.path is None and ckpt.revision not in cached_before:
                summary.pruned += delete_cached_revisions(seq.source, [ckpt.revision])
        bar.update(1)
    bar.close()
    if summary.busy:
        _say(progress, f"{len(summary.busy)} checkpoints are being probed by another process on "
                       f"{run_dir} ({short_list(summary.busy)}); re-run later to pick up any it leaves")
    if refused and len(refused) == len(mine):  # every checkpoint refused: the input is wrong
        raise refused[0]
    return summary


def _probe_one(seq: CheckpointSequence, ckpt: Checkpoint, box: list, lock: FileLock,
               data: EvalData, run_dir: Path, config: SweepConfig, progress: bool
               ) -> Exception | None:
    """Probe one loaded checkpoint and write its results; a failure goes to failures.jsonl and
    is returned (an unsupported model is raised: every checkpoint would fail the same way)."""
    model = box.pop()
    try:
        if isinstance(model, Exception):
            raise model
        frame = probe_model(model, data, config, progress=progress, desc=ckpt.revision)
        results.write_checkpoint(run_dir, ckpt.revision, tidy_frame(frame, seq, ckpt))
        return None
    except UnsupportedModelError:
        raise
    except Exception as exc:
        results.append_failure(run_dir, {
            "revision": ckpt.revision,
            "step": ckpt.step,
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
            "traceback": traceback.format_exc(limit=5),
        })
        return exc
    finally:
        del model  # the last reference: the loader keeps none (see _loader)
        _free_memory()
        lock.release()
