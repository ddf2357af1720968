"""Peak extra memory of a probed forward pass against the plain forward, as T grows.

The probes compute attention logits one chunk of query rows at a time, so the extra memory
should grow like chunk x T per head (linearly in T), not like T^2. Prints, per T, the peak RSS
increase of a plain forward and of a probed forward (both measured in this process with the
kernel's peak-RSS counter reset before each), and the size a full T x T x H float32 score matrix
would take, as the quadratic baseline.

    python benchmarks/memory.py            # T = 512, 1024, 2048, 4096
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.hooks import ProbeConfig, attach


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_increase_mb(fn, repeats: int = 3) -> float:
    """Smallest peak-RSS increase over ``repeats`` calls (the allocator's caching is noisy)."""
    best = float("inf")
    for _ in range(repeats):
        with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
            fh.write("5")
        base = _status_kb("VmRSS")
        fn()
        best = min(best, (_status_kb("VmHWM") - base) / 1024)
    return best


def measure(lengths: list[int], heads: int = 8, chunk: int = 32) -> dict[int, dict[str, float]]:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=64, hidden_size=8 * heads, num_hidden_layers=1, num_attention_heads=heads,
        intermediate_size=16 * heads, max_position_embeddings=max(lengths),
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    out: dict[int, dict[str, float]] = {}
    for t in lengths:
        ids = torch.randint(0, 64, (1, t))
        with torch.no_grad():
            model(input_ids=ids)  # warm the allocator
            plain = _peak_increase_mb(lambda ids=ids: model(input_ids=ids))
        with attach(model, ProbeConfig(chunk=chunk)) as probe:
            probe.run_batch(ids)
            probed = _peak_increase_mb(lambda ids=ids, probe=probe: probe.run_batch(ids))
        out[t] = {
            "plain_mb": plain,
            "probed_mb": probed,
            "extra_mb": probed - plain,
            "full_scores_mb": t * t * heads * 4 / 2**20,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    res = measure(args.lengths)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'T':>6} {'plain MB':>9} {'probed MB':>10} {'extra MB':>9} {'T*T*H f32 MB':>13} {'extra/TxT':>10}")
    for t, r in res.items():
        ratio = r["extra_mb"] / r["full_scores_mb"]
        print(f"{t:>6} {r['plain_mb']:>9.1f} {r['probed_mb']:>10.1f} {r['extra_mb']:>9.1f} "
              f"{r['full_scores_mb']:>13.1f} {ratio:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
