"""The Hugging Face ``Trainer`` integration: :class:`PeakprobeCallback`, a Monitor driven by the
Trainer's events.

Usage::

    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(PeakprobeCallback(trainer, eval_data, "run"))
    trainer.train()

The callback probes at the Monitor's planned steps over ``state.max_steps`` (step 0 in
``on_train_begin``, the others in ``on_step_end``, where the weights are those a checkpoint
saved at that step holds), records the learning rate of every optimizer update, and passes the
summary scalars through ``trainer.log`` so that every ``report_to`` integration (TensorBoard,
W&B, ...) receives them at the right step. The trainer is needed for that last part: a callback
is only handed the model, optimizer and scheduler, and mutating another event's logs would
reach only the callbacks registered after this one. Without a trainer the probes are still
written, just not logged. Under ``torch.distributed`` (DDP, or FSDP2 through accelerate) every
rank probes its share and process zero writes the merged run (peakprobe.integrations.distributed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .. import vocab
from ..data import EvalData
from ..sweep import SweepConfig
from .monitor import Monitor


class PeakprobeCallback(TrainerCallback):
    """Probe a Trainer's model at planned steps and write a peakprobe run directory ``run_dir``.

    ``n_points`` log-spaced steps over the planned training (from the warmup's end, or
    ``start``), plus every ``every`` steps and the explicit ``steps``; ``attribution_points`` of
    them also run the attribution (see ``Monitor``). The run's name and source
    default to the Trainer's ``output_dir`` (where its ``checkpoint-<N>/`` folders go), so the
    manifest names what a later sweep of those checkpoints would name.
    """

    def __init__(
        self,
        trainer: Any,
        data: EvalData,
        run_dir: str | os.PathLike,
        *,
        n_points: int = vocab.MONITOR_POINTS,
        attribution_points: int | None = vocab.MONITOR_ATTRIBUTION_POINTS,
        start: int | None = None,
        every: int | None = None,
        steps: tuple[int, ...] = (),
        config: SweepConfig | None = None,
        top_k: int = vocab.MONITOR_TOP_HEADS,
        force: bool = False,
    ) -> None:
        self.trainer = trainer
        self.data = data
        self.run_dir = Path(run_dir)
        self.options = dict(n_points=n_points, attribution_points=attribution_points, every=every, steps=steps, config=config,
                            top_k=top_k, force=force)
        self.start = start
        self.monitor: Monitor | None = None

    def _log(self, scalars: dict, step: int) -> None:
        if self.trainer is not None:
            self.trainer.log(dict(scalars))  # the Trainer stamps its global step

    def _tokens(self, args, state) -> int | None:
        seen = getattr(state, "num_input_tokens_seen", 0)
        return int(seen) if args.include_num_input_tokens_seen not in (False, "no") and seen else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        start = self.start if self.start is not None else max(1, args.get_warmup_steps(state.max_steps))
        folder = Path(args.output_dir).resolve()
        self.monitor = Monitor(
            self.data, self.run_dir, total_steps=state.max_steps, start=start, name=folder.name,
            source=str(folder), log=self._log, rank=0 if state.is_world_process_zero else 1,
            **self.options,
        )
        self.monitor.watch(model, optimizer, lr_scheduler)
        return self._step(args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            return self._step(args, state, control)

    def _step(self, args, state, control):
        # trainer.log's on_log event clears control.should_log; keep the Trainer's own decision
        # (else its training loss would go unlogged at every probed step)
        should_log = control.should_log
        self.monitor.step(state.global_step, tokens=self._tokens(args, state))
        control.should_log = should_log
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
