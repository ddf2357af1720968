"""Training wall time of the demo's tiny LM with a live Monitor at the default cadence, against
the same training without it.

    python benchmarks/monitor.py [--steps N] [--windows W] [--threads T] [--rounds R]
                                 [--no-attribution]
                                 [--attribution-points K | --attribution-every-probe]

The model, data, schedule and probe settings are the demo's (``peakprobe demo``): 800 updates of
a 4-layer GPT-NeoX, probed at about 40 log-spaced steps after the warmup on the demo's 8
windows of 256 tokens, 8 of them (the Monitor's default) with the attribution on the first 2
windows (``peakprobe.integrations.live_config``). ``--steps`` shortens the training (the cadence
stays 40 probes, so the overhead ratio grows). Each round trains both ways, the order swapped
from round to round so that an order effect does not land on one side only. Prints each
round's times, the median of the rounds' ratios, and the time spent probing against the
training without the Monitor.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
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
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the order swapped each round")
    parser.add_argument("--no-attribution", action="store_true")
    parser.add_argument("--attribution-points", type=int, default=vocab.MONITOR_ATTRIBUTION_POINTS)
    parser.add_argument("--attribution-every-probe", action="store_true")
    args = parser.parse_args()
    cfg = dataclasses.replace(TinyLMConfig(), steps=args.steps)
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, cfg.seq_len))
    data = load_eval_data("embedded", tokenizer, n_windows=args.windows, window=cfg.seq_len)
    sweep_cfg = dataclasses.replace(live_config(attribution=not args.no_attribution), batch_size=8)
    print(f"tiny LM: {cfg.steps} updates, {cfg.n_layers} layers x {cfg.n_heads} heads, batch "
          f"{cfg.batch_size} x {cfg.seq_len} tokens, {args.threads} thread(s)")
    rounds = []  # (plain (wall, cpu), live (wall, cpu), probe seconds)
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            monitor = Monitor(data, tmp / "run", total_steps=cfg.steps, start=max(1, cfg.warmup_steps),
                              config=sweep_cfg, lr_max=cfg.lr_max, schedule=cfg.schedule(),
                              attribution_points=None if args.attribution_every_probe else args.attribution_points)

            def live(monitor=monitor, tmp=tmp):
                with monitor:
                    return _train(tmp / "live", cfg, args.threads, monitor)

            if r % 2 == 0:
                plain, timed = _train(tmp / "plain", cfg, args.threads, None), live()
            else:
                timed, plain = live(), _train(tmp / "plain", cfg, args.threads, None)
        rounds.append((plain, timed, monitor.probe_seconds))
        n = len(monitor.done)
        if r == 0:
            print(f"probes: {n} at the default cadence, {args.windows} windows x {cfg.seq_len} tokens; "
                  f"attribution at {len(monitor.attribution_steps)} of them")
        first = "without first" if r % 2 == 0 else "with first"
        print(f"round {r + 1} ({first}): without monitor {plain[0]:7.1f} s wall {plain[1]:7.1f} s CPU; "
              f"with monitor {timed[0]:7.1f} s wall {timed[1]:7.1f} s CPU "
              f"({monitor.probe_seconds:.1f} s probing, {monitor.probe_seconds / max(n, 1):.2f} s per probe)")
    wall = statistics.median(t[0] / p[0] for p, t, _ in rounds)
    cpu = statistics.median(t[1] / p[1] for p, t, _ in rounds)
    own = statistics.median(1 + s / p[0] for p, _, s in rounds)
    print(f"overhead, median of {len(rounds)} rounds: {wall:.3f}x wall, {cpu:.3f}x CPU; "
          f"the probes' own time {own:.3f}x the training without the Monitor")
    if cfg.steps != TinyLMConfig().steps:  # probes cost the same; training scales with steps
        full = TinyLMConfig().steps
        extra = statistics.median((t[1] - p[1]) / (p[1] * full / cfg.steps) for p, t, _ in rounds)
        print(f"extrapolated to the demo's {full} updates: {1 + extra:.3f}x CPU")

if __name__ == "__main__":
    main()
