"""Forward throughput on CPU: the probed model against the plain model, measured in one run.

Shape from REFERENCE.md's CPU anchor: a 6-layer, 256-wide, 8-head GPT-NeoX (vocab 1024),
float32, batch 8 x 512 tokens. Prints tokens/s of the plain sdpa forward (the baseline), the
probed forward (statistics of every head and the LM head; chunk sizes as given), and the probed
forward with the sensitivity backward pass, each as a ratio to the baseline.

    python benchmarks/throughput.py [--repeats 3] [--chunks 32 64 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.hooks import ProbeConfig, attach


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=6, num_attention_heads=8, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 1024, (args.batch, args.length))
    tokens = ids.numel()

    def plain():
        with torch.no_grad():
            model(input_ids=ids)

    base = _best_time(plain, args.repeats)
    rows = [("plain sdpa (baseline)", base)]
    for chunk in args.chunks:
        with attach(model, ProbeConfig(chunk=chunk, backend="torch")) as probe:
            rows.append((f"probed, chunk {chunk}", _best_time(lambda p=probe: p.run_batch(ids), args.repeats)))
    with attach(model, ProbeConfig(chunk=args.chunks[0], sensitivity=True, backend="torch")) as probe:
        rows.append(("probed + sensitivity backward", _best_time(lambda: probe.run_batch(ids), args.repeats)))
    print(f"GPT-NeoX 6 x 256, 8 heads, vocab 1024, float32, batch {args.batch} x {args.length}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'variant':<32}{'tok/s':>10}{'x baseline':>12}")
    for name, seconds in rows:
        print(f"{name:<32}{tokens / seconds:>10,.0f}{base / seconds:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
