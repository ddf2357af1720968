"""The cost of the attribution: one checkpoint's sweep (probe_model over the evaluation windows)
with the default attribution against the same sweep forward-only, measured in one run.

Model: the CPU benchmark model of benchmarks/throughput.py, a random-init 6-layer, 256-wide,
8-head GPT-NeoX (vocab 1024, 2048 positions), float32, batch 8, and a sweep's defaults: 64
evaluation windows of 1024 tokens (``data.DEFAULT_WINDOW``; ``--length 512`` gives the
throughput benchmark's shorter windows). Variants: the forward-only sweep (the baseline), the
default attribution (single heads screened: ``--head-gains screen``), the attribution without
single heads, and, with ``--every-head``, every head searched (``--head-gains search``), the
cost where every head's gain matters.

The variants run interleaved, one of each per round, so that each round's ratios compare runs
taken moments apart: the machine's speed drifts by tens of percent over minutes, and a baseline
timed before the variants would carry that drift into the ratio. Prints each variant's median
seconds and its ratio to the same round's baseline (median, and the range over rounds).

``--size`` builds a random-init GPT-NeoX of a Pythia shape (vocab 50304) instead, and
``--device cuda`` runs everything on a GPU (float32; the probes' backend ``--backend``, e.g.
``auto``, the default path, or ``triton``): the cost where evaluations are cheap and launches are not.

    python benchmarks/sweep_cost.py [--rounds 3] [--windows 64] [--length 1024] [--every-head]
        [--attribution-windows 4] [--size 160m] [--device cuda] [--backend auto]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.checkpoint import probe_model
from peakprobe.checkpoints_index import PYTHIA_SHAPES
from peakprobe.config import AttributionConfig, ProbeConfig, SweepConfig
from peakprobe.data import DEFAULT_WINDOW, EvalData, token_hash


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--length", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--every-head", action="store_true", help="also time every head searched")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--attribution-windows", type=int, default=AttributionConfig().windows)
    parser.add_argument("--size", choices=tuple(PYTHIA_SHAPES), default=None,
                        help="a Pythia shape instead of the CPU benchmark model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch", help="the probes' backend (torch, auto, ...)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's weights dtype (the attribution runs in it)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.size is None:
        vocab, shape = 1024, (6, 256, 8)
    else:
        s = PYTHIA_SHAPES[args.size]
        vocab, shape = 50304, (s.n_layers, s.hidden_size, s.n_heads)
    cfg = GPTNeoXConfig(vocab_size=vocab, num_hidden_layers=shape[0], hidden_size=shape[1],
                        num_attention_heads=shape[2], intermediate_size=4 * shape[1],
                        max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    ids = torch.randint(0, vocab, (args.windows, args.length))
    data = EvalData(ids, torch.ones_like(ids), "random", token_hash(ids))

    be = args.backend

    def run(**attribution):
        config = SweepConfig(batch_size=args.batch, probe=ProbeConfig(backend=be),
                             attribution=AttributionConfig(windows=args.attribution_windows, **attribution))
        return lambda: probe_model(model, data, config)

    plain, full, groups, every = {"enabled": False}, {}, {"heads": "off"}, {"heads": "search"}
    variants = [
        ("forward-only sweep (baseline)", run(**plain)),
        ("sweep + default attribution", run(**full)),
        ("sweep + attribution without head gains", run(**groups)),
    ] + ([("sweep + attribution, every head searched", run(**every))] if args.every_head else [])
    run(**plain)()  # warm-up
    times = np.array([[_seconds(fn) for _, fn in variants] for _ in range(args.rounds)])  # (rounds, variants)
    ratios = times / times[:, :1]
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"{torch.get_num_threads()} threads")
    print(f"GPT-NeoX {shape[0]} x {shape[1]}, {shape[2]} heads, vocab {vocab}, {args.dtype}, "
          f"{args.windows} windows x {args.length} tokens, batch {args.batch}, attribution on "
          f"{args.attribution_windows} windows, probes {be}, {where}, {args.rounds} interleaved rounds")
    print(f"{'variant':<42}{'seconds':>9}{'x baseline':>12}{'range':>14}")
    for j, (name, _) in enumerate(variants):
        lo, hi = ratios[:, j].min(), ratios[:, j].max()
        print(f"{name:<42}{np.median(times[:, j]):>9.1f}{np.median(ratios[:, j]):>12.2f}"
              f"{f'{lo:.2f}-{hi:.2f}':>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
