"""Live probing inside a training loop: the framework-free :class:`Monitor`.

A Monitor probes the model on fixed evaluation windows at planned steps (``planned_steps``; the
attribution at a log-spaced subset, ``attribution_steps``) and writes the run directory a sweep
writes, through the sweep's own functions, so ``peakprobe fit`` and ``report`` work on a run that
is still training. Each probe leaves training exactly as it was (``training_state_preserved``:
train/eval flags and every RNG state restored). Dynamic time tau sums lr_i / lr_max over the
updates (an optimizer step-pre-hook records lr_i; ``RUN/monitor.json`` keeps them). Under
``torch.distributed`` every rank probes its share and rank 0 writes (``integrations.distributed``).
What each option does, and the distributed layouts: docs/monitor.md.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from .. import results, vocab
from ..checkpoint import DTYPES, probe_model, tidy_frame, uses_attention_interface
from ..checkpoints_index import Checkpoint, CheckpointSequence, schedule_from_json
from ..config import AttributionConfig, ProbeConfig, SweepConfig
from ..data import EvalData
from ..hooks import UnsupportedModelError
from ..sweep import SweepOutcome, build_manifest, heal, move_aside, prepare_run_dir
from .distributed import (
    DEFAULT_TIMEOUT,
    GAINS_SKIPPED,
    DistributedProbeError,
    Layout,
    RankFailed,
    layout_of,
    probe_ranks,
    unwrap,
)
from .scalars import alarms, live_scalars

logger = logging.getLogger("peakprobe.monitor")

#: manifest entries that must match for a live run to continue in an existing run directory
#: (its checkpoints grow as it goes: the planned steps are compared instead)
_IDENTITY = ("format", "model", "source", "data", "probe", "attribution", "load")


class MonitorError(vocab.PeakprobeError):
    """A Monitor that cannot run: bad planned steps, no model watched, another run's folder."""


def planned_steps(
    total_steps: int,
    n_points: int = vocab.MONITOR_POINTS,
    *,
    start: int = 1,
    every: int | None = None,
    steps: Iterable[int] = (),
) -> list[int]:
    """Step 0, ``total_steps`` and about ``n_points`` log-spaced steps in ``[start, total_steps]``
    (distinct integers), plus every multiple of ``every`` and the explicit ``steps``."""
    if total_steps < 1:
        raise MonitorError(f"total_steps must be >= 1, got {total_steps}")
    if n_points < 2:
        raise MonitorError(f"n_points must be >= 2, got {n_points}")
    if every is not None and every < 1:
        raise MonitorError(f"every must be >= 1, got {every}")
    start = min(max(1, int(start)), total_steps)
    wanted = min(n_points, total_steps - start + 2)  # + step 0
    points: set[int] = {0, total_steps}
    k = max(2, n_points - 1)
    while len(points) < wanted:  # rounding merges early steps: densify until enough are distinct
        points = {0, total_steps} | {round(float(x)) for x in np.geomspace(start, total_steps, k)}
        k += 1
    if every:
        points |= set(range(0, total_steps + 1, every))
    bad = [s for s in steps if not 0 <= int(s) <= total_steps]
    if bad:
        raise MonitorError(f"steps {bad} are outside [0, total_steps={total_steps}]")
    return sorted(points | {int(s) for s in steps})


def live_config(*, attribution: bool = True, **probe: Any) -> SweepConfig:
    """The Monitor's default settings: a sweep's, with the attribution (when on) on
    ``vocab.MONITOR_ATTRIBUTION_WINDOWS`` windows (``probe`` overrides ProbeConfig fields)."""
    return SweepConfig(probe=ProbeConfig(**probe), attribution=AttributionConfig(
        enabled=attribution, windows=vocab.MONITOR_ATTRIBUTION_WINDOWS))


def attribution_steps(planned: Iterable[int], n_points: int | None, *, start: int = 1) -> list[int]:
    """The planned steps that also run the attribution: all of them (``n_points`` None), else the
    ones nearest to ``n_points`` log-spaced steps over the planned steps from ``start`` on
    (the last planned step always included; step 0, the initialisation, only when nothing
    else is planned)."""
    planned = sorted(int(s) for s in planned)
    if n_points is None:
        return planned
    if n_points < 1:
        raise MonitorError(f"attribution points must be >= 1 (or None for every probe), got {n_points}")
    late = [s for s in planned if s >= max(1, start)] or planned[-1:]
    if len(late) <= n_points:
        return late
    logs = np.log(np.asarray(late, dtype=float))
    chosen = {late[-1]}
    for target in np.linspace(logs[0], logs[-1], n_points)[:-1]:  # the last is late[-1]
        order = np.argsort(np.abs(logs - target), kind="stable")
        chosen.add(next((late[i] for i in order if late[i] not in chosen), late[int(order[0])]))
    return sorted(chosen)


@contextmanager
def training_state_preserved(model: torch.nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode for the block; afterwards restore every module's train flag
    and the python, numpy, torch CPU and (initialised) CUDA RNG states, also on error."""
    modes = [(m, m.training) for m in model.modules()]
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training  # per module: some may have been in eval on purpose
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that really steps (unwraps accelerate's AcceleratedOptimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MonitorError(f"expected a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


class Monitor:
    """Probe a model while it trains and write a peakprobe run directory (see the module doc).

    Plain loop::

        monitor = Monitor(eval_data, "run", total_steps=1000, log=writer)
        monitor.watch(model, optimizer, scheduler)
        monitor.step(0)
        for step in range(1, 1001):
            ...; optimizer.step(); scheduler.step()
            monitor.step(step)          # cheap unless ``step`` is planned

    ``start``: the log-spaced probes begin there (give the warmup's end); logit-std jump alarms
    compare only probes from there on. ``log`` receives the summary scalars of each probe: a
    callable ``log(scalars, step)`` or anything with ``add_scalar(tag, value, step)`` (a
    TensorBoard ``SummaryWriter``).
    ``attribution_points``: how many of the probes (log-spaced from ``start``, the last one
    included) also run the attribution when ``config`` asks for it; None: all of them.
    ``schedule`` (a schedule.json record) only describes the run in the manifest (the fits
    start their window after its ``warmup_steps``); tau always comes from the recorded rates.
    ``logit_max_alarm``: the largest attention logit that raises an alarm naming the head
    (default ``vocab.LOGIT_MAX_ALARM``, 100; None: none). Under ``torch.distributed`` call
    ``step`` on every rank; ``timeout``: seconds the merge waits for the other ranks.

    Any PyTorch model whose attention calls ``F.scaled_dot_product_attention`` (nanoGPT, litgpt,
    OLMo-core, torchtitan's sdpa path) is probed through those calls (``hooks.sdpa``): a model
    that does not route its attention through transformers' attention interface is, and so is
    any model given ``forward`` (``forward(input_ids)`` returns the logits, for models whose own
    call takes other arguments). Those probes measure the statistics; the attribution (gains)
    needs the attention interface and is left out, with one warning.
    """

    def __init__(
        self,
        data: EvalData,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        lr_max: float | None = None,
        n_points: int = vocab.MONITOR_POINTS,
        attribution_points: int | None = vocab.MONITOR_ATTRIBUTION_POINTS,
        start: int = 1,
        every: int | None = None,
        steps: Iterable[int] = (),
        config: SweepConfig | None = None,
        name: str = "live",
        source: str | None = None,
        schedule: dict | None = None,
        tokens_per_step: int | None = None,
        log: Callable[[dict, int], Any] | Any = None,
        top_k: int = vocab.MONITOR_TOP_HEADS,
        rank: int | None = None,
        force: bool = False,
        command: str | None = None,
        logit_max_alarm: float | None = vocab.LOGIT_MAX_ALARM,
        forward: Callable | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.data = data
        self.logit_max_alarm = logit_max_alarm
        self.forward = forward
        self.timeout = float(timeout)
        self.run_dir = Path(run_dir)
        self.total_steps = int(total_steps)
        self.planned = planned_steps(total_steps, n_points, start=start, every=every, steps=steps)
        self.start = max(1, int(start))
        self._planned_set = set(self.planned)
        self.config = config or live_config()
        self.attribution_steps = (attribution_steps(self.planned, attribution_points, start=self.start)
                                  if self.config.attribution.active else [])
        self._stats_only = replace(self.config, attribution=replace(self.config.attribution, enabled=False))
        self.name = name
        self.source = source or str(self.run_dir.resolve())
        self.schedule = None if schedule is None else schedule_from_json(schedule)
        self.tokens_per_step = tokens_per_step
        self.log = log
        self.top_k = top_k
        self.rank = _default_rank() if rank is None else int(rank)
        self.force = force
        self.command = command
        self.lr_max = lr_max
        self.lr_max_source = "given" if lr_max is not None else None
        self._start_state()
        if model is not None:
            self.watch(model, optimizer, scheduler)

    def _start_state(self) -> None:
        """What the Monitor learns as training runs: nothing yet."""
        self.layout = Layout()
        self.gains_skipped: str | None = None
        self.all_reduces = 0  # all-reduces the last distributed probe ran
        self._template = None  # this rank's statistics layout, for a probe that fails early
        self.lrs: list[float] = []
        self.done: dict[int, Checkpoint] = {}
        self.failed: list[str] = []
        self.alarms: list[str] = []
        self.probe_seconds = 0.0
        self.model: torch.nn.Module | None = None
        self._hook = None
        self._previous: pd.DataFrame | None = None
        self._prepared = False

    # -- set-up ------------------------------------------------------------------------------
    def watch(self, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None) -> None:
        """Probe ``model`` (a DDP wrapper is unwrapped) and record ``optimizer``'s learning rates.
        Under ``torch.distributed`` the model's layout over the ranks is read here."""
        self.layout = layout_of(model)
        model = unwrap(model)  # probe the module itself: no gradient sync
        self.model = model
        if self.layout.sharded and self.config.attribution.active:
            if self.rank == 0:
                logger.warning("peakprobe: %s", GAINS_SKIPPED)
            self.gains_skipped = GAINS_SKIPPED
            self.config, self.attribution_steps = self._stats_only, []
        if (self.forward is not None or not uses_attention_interface(model)) and self.config.attribution.active:
            warnings.warn(f"{type(model).__name__} is probed through its F.scaled_dot_product_attention "
                          "calls: statistics only (the attribution needs transformers' attention "
                          "interface)", vocab.PeakprobeWarning, stacklevel=2)
            self.config, self.attribution_steps = self._stats_only, []
        if optimizer is not None and self._hook is None:
            inner = _inner_optimizer(optimizer)
            self._hook = inner.register_step_pre_hook(self._record_lr)
            if self.lr_max is None:
                group = inner.param_groups[0]
                base = getattr(scheduler, "base_lrs", None)
                if base:
                    self.lr_max, self.lr_max_source = float(base[0]), "scheduler base lr"
                elif "initial_lr" in group:
                    self.lr_max, self.lr_max_source = float(group["initial_lr"]), "initial_lr"
                else:
                    self.lr_max, self.lr_max_source = float(group["lr"]), "optimizer lr at start"

    def on_step(self, step: int, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None):
        """The generic per-step callback ``on_step(step, model, optimizer, scheduler)``."""
        if self.model is None:
            self.watch(model, optimizer, scheduler)
        return self.step(step)

    def close(self) -> None:
        """Stop recording learning rates (the run directory stays as written)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _record_lr(self, optimizer, args, kwargs) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    # -- time ----------------------------------------------------------------------------------
    def tau(self) -> float | None:
        """Dynamic time after the updates recorded so far; None when no rate is known."""
        if not self.lr_max:
            return None
        return math.fsum(self.lrs) / self.lr_max

    def due(self, step: int) -> bool:
        return (self.rank == 0 or self.layout.world > 1) and int(step) in self._planned_set

    def is_complete(self) -> bool:
        """True when every planned step of this run directory has its parquet."""
        return (self.run_dir / results.MANIFEST).exists() and all(
            results.checkpoint_path(self.run_dir, f"step{s}").exists() for s in self.planned
        )

    # -- probing -------------------------------------------------------------------------------
    def step(self, step: int, *, lr: float | None = None, tokens: int | None = None) -> pd.DataFrame | None:
        """Call once per training step: probe if ``step`` is planned (every rank of a
        distributed run; else rank 0 only).

        ``lr`` is for loops without an optimizer watched: the rate of the update that led to
        ``step`` (call at every step then, so that tau sums every update)."""
        if lr is not None and self._hook is None:
            if self.lr_max is None:
                self.lr_max, self.lr_max_source = float(lr), "first lr given"
            self.lrs.append(float(lr))
        if not self.due(step):
            return None
        return self.probe(step, tokens=tokens)

    def probe(self, step: int, *, tokens: int | None = None) -> pd.DataFrame | None:
        """Probe now and write ``checkpoints/step<step>.parquet``; the tidy frame, or None if the
        probe failed (recorded in failures.jsonl; training goes on)."""
        if self.model is None:
            raise MonitorError("Monitor.probe needs a model: call watch(model, optimizer) first")
        if self.rank != 0 and self.layout.world == 1:
            return None
        step = int(step)
        if tokens is None and self.tokens_per_step is not None:
            tokens = step * self.tokens_per_step
        ckpt = Checkpoint(revision=f"step{step}", step=step, tokens=tokens, tau=self.tau())
        if self.rank == 0:
            self._prepare()
        started = time.perf_counter()
        try:
            with training_state_preserved(self.model):
                frame = self._probe_frame(self.config if step in self.attribution_steps else self._stats_only)
            if frame is None:
                return None
            tidy = tidy_frame(frame, self._sequence(), ckpt)
            results.write_checkpoint(self.run_dir, ckpt.revision, tidy)
        except (UnsupportedModelError, DistributedProbeError):
            raise  # every probe of this model would fail the same way; or the ranks lost each other
        except Exception as exc:  # never fatal to the training
            if self.rank == 0:  # rank 0 says it
                self._record_failure(exc, ckpt)
            return None
        self._recorded(tidy, ckpt, time.perf_counter() - started)
        return tidy

    def _probe_frame(self, config: SweepConfig) -> pd.DataFrame | None:
        """The probe's frame: one process's, or under ``torch.distributed`` every rank's share
        merged (on rank 0; None on the other ranks)."""
        if self.layout.world == 1:
            return probe_model(self.model, self.data, config, forward=self.forward)
        got = probe_ranks(self.model, self.data, config, self.layout, forward=self.forward,
                          timeout=self.timeout, template=self._template)
        self.all_reduces, self._template = got.all_reduces, got.template or self._template
        if got.failures:
            raise RankFailed(got.failures, got.traces)
        return got.frame

    def _record_failure(self, exc: Exception, ckpt: Checkpoint) -> None:
        """One line in failures.jsonl (with the failed ranks under ``torch.distributed``) and a
        warning."""
        ranks = isinstance(exc, RankFailed)
        error = str(exc) if ranks else f"{type(exc).__name__}: {exc}".splitlines()[0]
        results.append_failure(self.run_dir, {
            "revision": ckpt.revision, "step": ckpt.step, "error": error,
            "traceback": "\n".join(exc.traces.values()) if ranks else traceback.format_exc(limit=5),
            **({"ranks": sorted(exc.failures)} if ranks else {}),
        })
        self.failed.append(ckpt.revision)
        logger.warning("peakprobe: probe at step %d failed: %s", ckpt.step, error)

    def _recorded(self, tidy: pd.DataFrame, ckpt: Checkpoint, seconds: float) -> None:
        """After a written probe: its alarms, the manifest, the logged scalars."""
        self.probe_seconds += seconds
        self.done[ckpt.step] = ckpt
        # logit std grows fast away from the initialisation and in warmup: compare only from
        # the first log-spaced step (``start``, the warmup's end where known) on
        jumps = self._previous is not None and int(self._previous["step"].iloc[0]) >= self.start
        for message in alarms(self._previous, tidy, jumps=jumps, logit_max_limit=self.logit_max_alarm):
            self.alarms.append(message)
            logger.warning("peakprobe: %s", message)
        self._previous = tidy
        self._write_manifest()
        scalars = live_scalars(tidy, self.top_k)
        if ckpt.tau is not None:
            scalars["peakprobe/tau"] = ckpt.tau
        scalars["peakprobe/probe_seconds"] = seconds
        self._emit(scalars, ckpt.step)

    def outcome(self) -> SweepOutcome:
        """What the run directory holds, in the sweep's terms (probed / failed revisions)."""
        done = sorted(p.stem for p in (self.run_dir / results.CHECKPOINTS).glob("*.parquet"))
        return SweepOutcome(self.run_dir, done, [], list(self.failed))

    # -- writing -------------------------------------------------------------------------------
    def _sequence(self) -> CheckpointSequence:
        planned = {s: Checkpoint(f"step{s}", s, None if self.tokens_per_step is None
                                 else s * self.tokens_per_step, None) for s in self.planned}
        planned.update(self.done)
        return CheckpointSequence(self.name, self.source, list(planned.values()), self.schedule)

    def _manifest(self) -> dict:
        config = self.config
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        if dtype in DTYPES and dtype != config.dtype:
            config = replace(config, dtype=dtype)  # the manifest states what was probed
        manifest = build_manifest(self._sequence(), self.data, config, self.command)
        if manifest.get("attribution"):  # live probes run it at these steps only
            manifest["attribution"]["steps"] = list(self.attribution_steps)
        return manifest

    def _prepare(self) -> None:
        """Create the run directory at the first probe, or check it belongs to this run."""
        if self._prepared:
            return
        manifest = self._manifest()
        path = self.run_dir / results.MANIFEST
        try:
            old = results.read_manifest(self.run_dir) if path.exists() and not self.force else None
        except results.DamagedFileError:
            move_aside(path, "does not read back", "writing it again")
            old = None
        if old is not None:
            same = results.run_identity(old, _IDENTITY) == results.run_identity(manifest, _IDENTITY)
            old_steps = sorted(c["step"] for c in old.get("checkpoints", []))
            if not same or old_steps != self.planned:
                raise MonitorError(
                    f"{self.run_dir} holds results of another run; use another run directory "
                    "or force=True to start over"
                )
            self._resume()
            (self.run_dir / results.CHECKPOINTS).mkdir(parents=True, exist_ok=True)
            heal(self.run_dir, list(self._sequence()), manifest)
        else:
            prepare_run_dir(self.run_dir, manifest, force=self.force)
        self._prepared = True

    def _resume(self) -> None:
        """Continue the learning-rate record of an interrupted run (tau keeps counting)."""
        path = self.run_dir / vocab.MONITOR_FILE
        if self.lrs or not path.exists():
            return
        record = results.read_json_object(path, "the learning rates of the interrupted run are lost: "
                                          "start the run directory over (force=True)")
        self.lrs = [float(x) for x in record.get("lr", [])]

    def _write_manifest(self) -> None:
        results.write_json(self.run_dir / results.MANIFEST, self._manifest())
        results.write_json(self.run_dir / vocab.MONITOR_FILE, {
            "format": 1,
            "planned_steps": self.planned,
            "lr_max": self.lr_max,
            "lr_max_source": self.lr_max_source,
            "lr": self.lrs,
            "probe_seconds": self.probe_seconds,
            "alarms": self.alarms,
            "distributed": self.layout.describe(),
            "gains_skipped": self.gains_skipped,
        })

    def _emit(self, scalars: dict[str, float], step: int) -> None:
        if self.log is None:
            return
        if hasattr(self.log, "add_scalar"):
            for tag, value in scalars.items():
                self.log.add_scalar(tag, value, step)
            if hasattr(self.log, "flush"):
                self.log.flush()
        else:
            self.log(scalars, step)
