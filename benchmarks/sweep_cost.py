"""The cost of the attribution: one checkpoint's sweep (probe_model over the evaluation windows)
with the default attribution against the same sweep forward-only, measured in one run.

Model: the CPU benchmark shape of benchmarks/throughput.py, a random-init 6-layer, 256-wide,
8-head GPT-NeoX (vocab 1024), float32, batch 8 x 512 tokens, 64 evaluation windows. Prints the
seconds of each variant (best of --repeats) and their ratio to the forward-only sweep: the
default attribution (single heads screened: ``--head-gains screen``), the attribution without
single heads, and, as the cost where every head's gain matters, every head searched
(``--head-gains search``).

    python benchmarks/sweep_cost.py [--repeats 2] [--windows 64] [--attribution-windows 4]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.data import EvalData, token_hash
from peakprobe.hooks import ProbeConfig
from peakprobe.sweep import SweepConfig, probe_model


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--attribution-windows", type=int, default=ProbeConfig().attribution_windows)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=6, num_attention_heads=8, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 1024, (args.windows, args.length))
    data = EvalData(ids, torch.ones_like(ids), "random", token_hash(ids))

    def run(probe: ProbeConfig):
        return lambda: probe_model(model, data, SweepConfig(batch_size=args.batch, probe=probe))

    plain = ProbeConfig(sensitivity=False, backend="torch")
    full = ProbeConfig(backend="torch", attribution_windows=args.attribution_windows)
    groups = ProbeConfig(backend="torch", attribution_windows=args.attribution_windows,
                         attribution_heads="off")
    every = ProbeConfig(backend="torch", attribution_windows=args.attribution_windows,
                        attribution_heads="search")
    run(plain)()  # warm-up
    rows = [
        ("forward-only sweep (baseline)", _best_time(run(plain), args.repeats)),
        ("sweep + default attribution", _best_time(run(full), args.repeats)),
        ("sweep + attribution without head gains", _best_time(run(groups), args.repeats)),
        ("sweep + attribution, every head searched", _best_time(run(every), args.repeats)),
    ]
    base = rows[0][1]
    print(f"GPT-NeoX 6 x 256, 8 heads, vocab 1024, float32, {args.windows} windows x {args.length} "
          f"tokens, batch {args.batch}, attribution on {args.attribution_windows} windows, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'variant':<42}{'seconds':>10}{'x baseline':>12}")
    for name, seconds in rows:
        print(f"{name:<42}{seconds:>10.1f}{seconds / base:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
