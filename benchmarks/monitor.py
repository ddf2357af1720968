"""Training wall time of the demo's tiny LM with a live Monitor at the default cadence, against
the same training without it.

    python benchmarks/monitor.py [--steps N] [--windows W] [--threads T] [--no-sensitivity]
                                 [--attribution-points K | --attribution-every-probe]

The model, data, schedule and probe settings are the demo's (``peakprobe demo``): 800 updates of
a 4-layer GPT-NeoX, probed at about 40 log-spaced steps after the warmup on the demo's 8
windows of 256 tokens, 8 of them (the Monitor's default) with the attribution on the first 2
windows (``peakprobe.integrations.live_config``). ``--steps`` shortens the training (the cadence
stays 40 probes, so the overhead ratio grows). Prints both times, the ratio, and the time spent
probing.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from peakprobe import corpus, vocab
from peakprobe.api import DEMO_WINDOWS
from peakprobe.data import load_eval_data
from peakprobe.integrations import Monitor, live_config
from peakprobe.toy.tiny_lm import TinyLMConfig, train_tiny_lm


def _train(folder: Path, cfg: TinyLMConfig, threads: int, monitor: Monitor | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one training run."""
    wall, cpu = time.perf_counter(), time.process_time()
    on_step = None if monitor is None else monitor.on_step
    train_tiny_lm(folder, cfg, progress=False, threads=threads, on_step=on_step, retrain=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TinyLMConfig().steps)
    parser.add_argument("--windows", type=int, default=DEMO_WINDOWS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-sensitivity", action="store_true")
    parser.add_argument("--attribution-points", type=int, default=vocab.MONITOR_ATTRIBUTION_POINTS)
    parser.add_argument("--attribution-every-probe", action="store_true")
    args = parser.parse_args()
    cfg = dataclasses.replace(TinyLMConfig(), steps=args.steps)
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, cfg.seq_len))
    data = load_eval_data("embedded", tokenizer, n_windows=args.windows, window=cfg.seq_len)
    sweep_cfg = dataclasses.replace(live_config(sensitivity=not args.no_sensitivity), batch_size=8)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plain = _train(tmp / "plain", cfg, args.threads, None)
        monitor = Monitor(data, tmp / "run", total_steps=cfg.steps, start=max(1, cfg.warmup_steps),
                          config=sweep_cfg, lr_max=cfg.lr_max, schedule=cfg.schedule(),
                          attribution_points=None if args.attribution_every_probe else args.attribution_points)
        with monitor:
            live = _train(tmp / "live", cfg, args.threads, monitor)
    n = len(monitor.done)
    print(f"tiny LM: {cfg.steps} updates, {cfg.n_layers} layers x {cfg.n_heads} heads, batch "
          f"{cfg.batch_size} x {cfg.seq_len} tokens, {args.threads} thread(s)")
    print(f"probes: {n} at the default cadence, {args.windows} windows x {cfg.seq_len} tokens; "
          f"attribution at {len(monitor.attribution_steps)} of them")
    print(f"without monitor: {plain[0]:8.1f} s wall  {plain[1]:8.1f} s CPU")
    print(f"with monitor:    {live[0]:8.1f} s wall  {live[1]:8.1f} s CPU  "
          f"({monitor.probe_seconds:.1f} s probing, {monitor.probe_seconds / max(n, 1):.2f} s per probe)")
    print(f"overhead: {live[0] / plain[0]:.3f}x wall, {live[1] / plain[1]:.3f}x CPU")
    if cfg.steps != TinyLMConfig().steps:  # probes cost the same; training scales with steps
        full = TinyLMConfig().steps
        cpu = 1 + (live[1] - plain[1]) / (plain[1] * full / cfg.steps)
        print(f"extrapolated to the demo's {full} updates: {cpu:.3f}x CPU")


if __name__ == "__main__":
    main()
