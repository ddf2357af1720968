"""Peak extra memory of a probed forward pass against the plain forward, as T grows.

The probes compute attention logits one chunk of query rows at a time, so the extra memory
should grow like chunk x T per head (linearly in T), not like T^2. Two measures, per T:

* live tensor bytes: the peak of the bytes held by live torch tensors during the forward,
  counted exactly by a dispatch mode that sees every allocation (deterministic, the number the
  linearity check uses);
* peak RSS: the kernel's peak-RSS counter reset before each call (what the process really
  used, allocator caching included; noisy by a few MB).

Both are printed next to the size a full T x T x H float32 score matrix would take, the
quadratic baseline.

    python benchmarks/memory.py            # T = 512, 1024, 2048, 4096
    python benchmarks/memory.py --backend torch
"""

from __future__ import annotations

import argparse
import json
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of tensor storages alive while the mode is on, and their peak.

    A storage is counted when an op first returns a tensor on it and released when the last
    tensor seen on it is collected; views share their base's storage and count once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, tensors alive]
        self.now = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [storage.nbytes(), 0]
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        return out


def _live_peak_mb(fn: Callable[[], object]) -> float:
    mode = LiveTensorBytes()
    with mode:
        fn()
    return mode.peak / 2**20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_peak_mb(fn: Callable[[], object], repeats: int = 3) -> float:
    """Smallest peak-RSS increase over ``repeats`` calls (the allocator's caching is noisy)."""
    best = float("inf")
    for _ in range(repeats):
        with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
            fh.write("5")
        base = _status_kb("VmRSS")
        fn()
        best = min(best, (_status_kb("VmHWM") - base) / 1024)
    return best


def measure(lengths: list[int], heads: int = 8, chunk: int = 32, backend: str = "auto"
            ) -> dict[int, dict[str, float]]:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=64, hidden_size=8 * heads, num_hidden_layers=1, num_attention_heads=heads,
        intermediate_size=16 * heads, max_position_embeddings=max(lengths),
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    out: dict[int, dict[str, float]] = {}
    for t in lengths:
        ids = torch.randint(0, 64, (1, t))

        def plain(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model(input_ids=ids)

        plain()  # warm the allocator
        row = {"plain_live_mb": _live_peak_mb(plain), "plain_rss_mb": _rss_peak_mb(plain)}
        with attach(model, ProbeConfig(chunk=chunk, backend=backend)) as probe:

            def probed(ids: torch.Tensor = ids) -> None:
                probe.run_batch(ids)

            probed()
            row["probed_live_mb"] = _live_peak_mb(probed)
            row["probed_rss_mb"] = _rss_peak_mb(probed)
        row["extra_live_mb"] = row["probed_live_mb"] - row["plain_live_mb"]
        row["extra_rss_mb"] = row["probed_rss_mb"] - row["plain_rss_mb"]
        row["full_scores_mb"] = t * t * heads * 4 / 2**20
        out[t] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--backend", default="auto", help="the probes' backend: auto, torch or triton")
    args = parser.parse_args(argv)
    res = measure(args.lengths, backend=args.backend)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'T':>6} {'extra live MB':>14} {'extra RSS MB':>13} {'T*T*H f32 MB':>13} "
          f"{'live/TxT':>9} {'live vs first T':>16}")
    first_t, first = next(iter(res.items()))
    for t, r in res.items():
        growth = r["extra_live_mb"] / first["extra_live_mb"]
        print(f"{t:>6} {r['extra_live_mb']:>14.2f} {r['extra_rss_mb']:>13.1f} "
              f"{r['full_scores_mb']:>13.1f} {r['extra_live_mb'] / r['full_scores_mb']:>9.3f} "
              f"{growth:>8.2f}x (T {t / first_t:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
