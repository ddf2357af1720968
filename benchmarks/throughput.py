"""Forward throughput on CPU: the probed model against the plain model, measured in one run.

Shape of the CPU anchor: a 6-layer, 256-wide, 8-head GPT-NeoX (vocab 1024), float32, batch
8 x 512 tokens, 2 threads. Every variant runs once per round, the rounds alternate the variants
(so a slow spell of a shared machine hits all of them), and each variant's time is the median
over the rounds. Variants: the plain sdpa forward (the baseline), the probed forward
(statistics of every head and the LM head) at each chunk size given, and the fused probed
forward (attention output from the probe's own scores).

    python benchmarks/throughput.py [--repeats 5] [--chunks 32 64 128] [--fused-chunk 64]
                                    [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (median over them)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--fused-chunk", type=int, nargs="*", default=[64],
                        help="chunk sizes of the fused variant (none: skip it)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by process CPU seconds instead of wall seconds (steadier on a "
                        "shared machine; with one thread only, as threads' waits count too)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=6, num_attention_heads=8, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 1024, (args.batch, args.length))
    tokens = ids.numel()

    def plain():
        with torch.no_grad():
            model(input_ids=ids)

    def probed(config: ProbeConfig):
        def run():
            with attach(model, config) as probe:
                probe.run_batch(ids)
        return run

    variants = [("plain sdpa (baseline)", plain)]
    variants += [(f"probed, chunk {c}", probed(ProbeConfig(chunk=c, backend="torch")))
                 for c in args.chunks]
    variants += [(f"probed fused, chunk {c}", probed(ProbeConfig(chunk=c, backend="torch", fused=True)))
                 for c in args.fused_chunk]
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _, fn in variants:
        fn()  # warm-up, untimed
    clock = time.process_time if args.cpu_time else time.perf_counter
    for _ in range(args.repeats):
        for name, fn in variants:
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    base = statistics.median(times[variants[0][0]])
    print(f"GPT-NeoX 6 x 256, 8 heads, vocab 1024, float32, batch {args.batch} x {args.length}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} alternating rounds"
          + (", CPU seconds" if args.cpu_time else ""))
    print(f"{'variant':<32}{'tok/s':>10}{'x baseline':>12}{'min..max s':>16}")
    for name, _ in variants:
        t = statistics.median(times[name])
        spread = f"{min(times[name]):.2f}..{max(times[name]):.2f}"
        print(f"{name:<32}{tokens / t:>10,.0f}{base / t:>12.2f}{spread:>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
