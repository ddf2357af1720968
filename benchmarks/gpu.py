"""GPU benchmark of the probes: probed forward vs plain sdpa, tokens/s and peak memory, and one
layer's attention: sdpa vs the fused kernel vs the torch path.

Random-init GPT-NeoX models of Pythia shapes (``PYTHIA_SHAPES``), bf16, batch 8 x 2048,
forward only, no padding. The modes per shape, measured in the same run:

* ``sdpa``          the plain model (transformers' sdpa attention), no peakprobe;
* ``probed``        under ``attach`` with the defaults (``backend="auto"``: on CUDA the fused
  Triton kernel, ``triton_kernel.kernel_site_sums``, one launch per attention layer);
* ``probed_torch``  ``backend="torch"``, the torch path with its default GPU blocks
  (``hooks.engine.GPU_BLOCK_ELEMENTS``);
* ``torch_cN``      the torch path with N query rows per block (``--chunks``);
* ``probed_2^E``    the torch path with a GPU block budget of 2^E elements (``--gpu-blocks``).

Probed modes call the model directly (attention statistics + LM-head statistics, lm_chunk
token positions per LM-head block), not ``run_batch`` (its loss would add a float32 copy of the
logits). Prints a table with ratios against sdpa (targets: probed >= 0.6x sdpa tokens/s, peak
memory within 1.15x), the largest relative difference between the kernel's and the torch path's
attention statistics (``probed`` vs ``probed_torch``), and per layer (``attention_ms``): one
layer's causal ``scaled_dot_product_attention`` against the kernel and the torch path on the
same q/k (the kernel's time includes its host-side work and the per-head float64 sums).
``--sweep`` also times the kernel under several launch configurations. ``--json`` writes
everything.

    python benchmarks/gpu.py --json out.json             # H200: both shapes, ~2 minutes
    python benchmarks/gpu.py --kernel-only               # per-layer attention timings only
    python benchmarks/gpu.py --smoke                     # CPU: tiny shapes, checks it runs
    TRITON_INTERPRET=1 python benchmarks/gpu.py --smoke --sweep   # CPU, kernel interpreted

On CPU the kernel runs only under ``TRITON_INTERPRET=1`` (interpreted, so its speed means
nothing there) and ``probed`` takes the torch path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.checkpoints_index import PYTHIA_SHAPES, ModelShape
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach, engine
from peakprobe.probes import MaskSpec, attention_head_sums

try:
    import triton

    from peakprobe.probes import triton_kernel
except ImportError:  # the torch-only modes still run
    triton = None
    triton_kernel = None

TARGET_SPEED = 0.6
TARGET_MEMORY = 1.15
SMOKE_SHAPE = ModelShape(n_layers=2, hidden_size=64, n_heads=4)


def kernel_runs(device: torch.device) -> bool:
    """The Triton kernel can run here: CUDA, or CPU under the interpreter (smoke checks)."""
    if triton_kernel is None:
        return False
    return device.type == "cuda" or triton_kernel.INTERPRETED


def build_model(shape: ModelShape, vocab: int, dtype: torch.dtype, device: torch.device):
    """Random-init GPT-NeoX of ``shape`` (Pythia layout), built directly on ``device``."""
    cfg = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        intermediate_size=4 * shape.hidden_size,
        max_position_embeddings=2048,
        rotary_pct=0.25,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], None], device: torch.device, warmup: int, iters: int
) -> tuple[float, float | None]:
    """(seconds per call, peak GiB allocated during the timed calls or None on CPU). On CUDA
    the calls are timed by CUDA events around all ``iters`` of them (the GPU's time, not the
    host's launch time); on CPU by the wall clock."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters, None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    per_call = begin.elapsed_time(end) / 1e3 / iters
    return per_call, torch.cuda.max_memory_allocated(device) / 2**30


def model_modes(model, ids, lm_chunk: int, chunks: list[int], blocks: list[int], device,
                warmup: int, iters: int, progress: bool):
    """Time the modes on one model; return (rows, max relative attention-stat diff of the
    kernel against the torch path, or None when the kernel did not run)."""
    n_tok = ids.numel()
    rows, frames = [], {}

    def plain():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    modes = [("sdpa", None, None, None), ("probed", "auto", None, None),
             ("probed_torch", "torch", None, None)]  # fmt: skip
    modes += [(f"torch_c{c}", "torch", c, None) for c in chunks]
    modes += [(f"probed_2^{e}", "torch", None, e) for e in blocks]
    default_block = engine.GPU_BLOCK_ELEMENTS
    for name, backend, chunk, block in modes:
        if progress:
            print(f"  {name} ...", file=sys.stderr, flush=True)
        if backend is None:
            sec, peak = measure(plain, device, warmup, iters)
        else:
            cfg = ProbeConfig(backend=backend, lm_chunk=lm_chunk, chunk=chunk)
            engine.GPU_BLOCK_ELEMENTS = default_block if block is None else 1 << block
            try:
                with attach(model, cfg) as probe:
                    sec, peak = measure(plain, device, warmup, iters)
                    df = probe.to_frame()
            finally:
                engine.GPU_BLOCK_ELEMENTS = default_block
            frames[name] = df[df.site_kind == "attn"].reset_index(drop=True)
        rows.append({"mode": name, "tokens_per_s": n_tok / sec, "ms_per_forward": 1e3 * sec,
                     "peak_gib": peak})  # fmt: skip
    base = rows[0]
    for row in rows:
        row["speed_vs_sdpa"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["memory_vs_sdpa"] = (
            row["peak_gib"] / base["peak_gib"] if row["peak_gib"] and base["peak_gib"] else None
        )
    diff = None
    if kernel_runs(device) and device.type == "cuda":  # "auto" took the kernel
        a, b = frames["probed"]["value"], frames["probed_torch"]["value"]
        diff = float(((a - b).abs() / b.abs().clip(lower=1e-12)).max())
    return rows, diff


def causal_ranges(seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) int32 (1, T): causal rows, row t sees keys 0..t."""
    end = torch.arange(1, seq + 1, dtype=torch.int32, device=device).view(1, seq)
    return torch.zeros_like(end), end


def attention_only(shape: ModelShape, batch: int, seq: int, dtype, device, warmup, iters):
    """Per layer, on random q/k/v: causal sdpa vs the kernel vs the torch path (ms per call)."""
    g = torch.Generator(device=device).manual_seed(0)
    h, d = shape.n_heads, shape.head_dim
    q, k, v = (torch.randn(batch, h, seq, d, generator=g, device=device, dtype=dtype)
               for _ in range(3))  # fmt: skip
    start, end = causal_ranges(seq, device)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if kernel_runs(device):
        fns["kernel"] = lambda: triton_kernel.kernel_site_sums(
            q, k, scaling=d**-0.5, start=start, end=end
        )
    rows = engine.block_rows(None, q, k)
    fns[f"torch_path (blocks of {rows} rows)"] = lambda: attention_head_sums(
        q, k, scaling=d**-0.5, mask=MaskSpec(), chunk=rows
    )
    out = {}
    for name, fn in fns.items():
        out[name] = 1e3 * measure(fn, device, warmup, iters)[0]
    return out


def lm_head_ms(batch: int, seq: int, vocab: int, dtype, device, warmup: int, iters: int) -> dict:
    """The LM head's statistics of one batch of logits (B, T, V) in the model's dtype (the
    default path, and the torch path) against a plain float32 log-softmax of the same logits,
    ms per call."""
    from peakprobe.hooks.engine import SiteStats, lm_targets

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=g, device=device, dtype=dtype) * 3
    ids = torch.randint(0, vocab, (batch, seq), generator=g, device=device)
    kept, target = lm_targets(ids, None)
    out = {"log_softmax": 1e3 * measure(lambda: logits.float().log_softmax(-1), device, warmup, iters)[0]}
    for name, backend in (("lm_head", "auto"), ("lm_head_torch", "torch")):
        stats = SiteStats(ProbeConfig(backend=backend))
        out[name] = 1e3 * measure(lambda: stats.lm_head(logits, kept, target), device, warmup, iters)[0]  # noqa: B023
        stats.end_batch()
    return out


def sweep(shape: ModelShape, batch: int, seq: int, dtype, device, iters: int) -> list[dict]:
    """Kernel-only ms per call (one layer, causal) under several launch configurations; the
    first is the default launch of this dtype and head dim."""
    g = torch.Generator(device=device).manual_seed(0)
    h, d = shape.n_heads, shape.head_dim
    q, k = (
        torch.randn(batch, h, seq, d, generator=g, device=device, dtype=dtype) for _ in range(2)
    )
    start, end = causal_ranges(seq, device)
    default = triton_kernel.launch_config(dtype, d)
    grid = [default] + [
        triton_kernel.LaunchConfig(*c)
        for c in [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                  (64, 32, 4, 3), (128, 128, 8, 2)]  # fmt: skip
        if triton_kernel.LaunchConfig(*c) != default
    ]
    results = []
    try:
        for cfg in grid:
            triton_kernel.set_launch_config(cfg)
            fn = lambda: triton_kernel.kernel_site_sums(  # noqa: E731
                q, k, scaling=d**-0.5, start=start, end=end
            )
            try:
                ms = 1e3 * measure(fn, device, 1, iters)[0]
            except Exception as e:  # a configuration the compiler rejects (resources)
                ms, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            else:
                err = None
            results.append({"block_m": cfg.block_m, "block_n": cfg.block_n,
                            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                            "ms": ms, "error": err})  # fmt: skip
    finally:
        triton_kernel.set_launch_config(None)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="160m,1.4b", help="Pythia sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument(
        "--lm-chunk", type=int, default=512, help="LM-head token positions per block at most"
    )
    parser.add_argument("--chunks", default="64,512,1024",
                        help="query rows per block of the torch_cN modes, comma-separated ('' none)")
    parser.add_argument("--gpu-blocks", default="",
                        help="probed_2^E modes: the torch path with GPU_BLOCK_ELEMENTS = 2^E, comma-separated")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument(
        "--kernel-only",
        action="store_true",
        help="skip the model forwards: per-layer attention timings (and --sweep) only",
    )
    parser.add_argument("--json", default=None, help="write the results to this path")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        shapes = {"smoke": SMOKE_SHAPE}
        batch, seq, vocab, dtype = 2, 64, 512, torch.float32
        warmup, iters = 1, 2
    else:
        if device.type != "cuda":
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        unknown = [s for s in args.sizes.split(",") if s not in PYTHIA_SHAPES]
        if unknown:
            print(
                f"unknown Pythia sizes {unknown}; known: {', '.join(PYTHIA_SHAPES)}",
                file=sys.stderr,
            )
            return 2
        shapes = {s: PYTHIA_SHAPES[s] for s in args.sizes.split(",")}
        batch, seq, vocab, dtype = args.batch, args.seq, args.vocab, torch.bfloat16
        warmup, iters = args.warmup, args.iters

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": getattr(triton, "__version__", None)},  # fmt: skip
        "batch": batch, "seq": seq, "dtype": str(dtype).replace("torch.", ""),
        "lm_chunk": args.lm_chunk, "warmup": warmup, "iters": iters,
        "targets": {"speed_vs_sdpa": TARGET_SPEED, "memory_vs_sdpa": TARGET_MEMORY},
        "shapes": {},
    }  # fmt: skip
    progress = not args.no_progress
    for size, shape in shapes.items():
        if progress:
            print(f"{size}: {shape}", file=sys.stderr, flush=True)
        rows, diff = [], None
        if not args.kernel_only:
            model = build_model(shape, vocab, dtype, device)
            ids = torch.randint(0, vocab, (batch, seq), device=device)
            chunks = [int(c) for c in args.chunks.split(",") if c]
            blocks = [int(e) for e in args.gpu_blocks.split(",") if e]
            rows, diff = model_modes(model, ids, args.lm_chunk, chunks, blocks, device, warmup,
                                     iters, progress)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        entry = {"shape": vars(shape), "modes": rows, "max_rel_diff_kernel_vs_torch": diff,
                 "attention_ms": attention_only(shape, batch, seq, dtype, device, warmup, iters)}  # fmt: skip
        probed = next((r for r in rows if r["mode"] == "probed"), None)
        if probed is not None and device.type == "cuda":
            entry["meets_targets"] = bool(
                probed["speed_vs_sdpa"] >= TARGET_SPEED
                and probed["memory_vs_sdpa"] <= TARGET_MEMORY
            )
        if args.sweep and kernel_runs(device):
            entry["sweep"] = sweep(shape, batch, seq, dtype, device, iters)
        report["shapes"][size] = entry

    report["lm_head_ms"] = lm_head_ms(batch, seq, vocab, dtype, device, warmup, iters)
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_table(report: dict) -> None:
    lm = report.get("lm_head_ms")
    if lm:
        print(f"LM head, batch {report['batch']} x {report['seq']}: statistics {lm['lm_head']:.2f} ms "
              f"(torch path {lm['lm_head_torch']:.2f} ms), a float32 log-softmax of the same logits "
              f"{lm['log_softmax']:.2f} ms")
    print(f"{report['device']}  {report['dtype']}  batch {report['batch']} x {report['seq']}  "
          f"lm_chunk {report['lm_chunk']}  ({report['date']})")  # fmt: skip
    print(f"{'shape':<8} {'mode':<14} {'tok/s':>11} {'x sdpa':>7} {'peak GiB':>9} {'mem x':>6}")
    for size, entry in report["shapes"].items():
        for r in entry["modes"]:
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            mem = f"{r['memory_vs_sdpa']:.2f}" if r["memory_vs_sdpa"] is not None else "-"
            print(f"{size:<8} {r['mode']:<14} {r['tokens_per_s']:>11,.0f} "
                  f"{r['speed_vs_sdpa']:>7.2f} {peak:>9} {mem:>6}")  # fmt: skip
        att = entry["attention_ms"]
        sdpa = att.get("sdpa")
        parts = [f"{k} {v:.3f} ms" + (f" ({v / sdpa:.2f}x sdpa)" if sdpa and k != "sdpa" else "")
                 for k, v in att.items()]  # fmt: skip
        print(f"{'':<8} per layer: {'  '.join(parts)}")
        if entry["max_rel_diff_kernel_vs_torch"] is not None:
            print(f"{'':<8} max rel diff of attention stats, kernel vs torch path: "
                  f"{entry['max_rel_diff_kernel_vs_torch']:.2e}")  # fmt: skip
        if "meets_targets" in entry:
            print(f"{'':<8} targets (>= {TARGET_SPEED}x sdpa, memory <= {TARGET_MEMORY}x): "
                  f"{'met' if entry['meets_targets'] else 'NOT met'}")  # fmt: skip
        for s in entry.get("sweep", []):
            ms = f"{s['ms']:.3f} ms" if s["ms"] is not None else s["error"]
            print(f"{'':<8} sweep block_m {s['block_m']:>3} block_n {s['block_n']:>3} "
                  f"warps {s['num_warps']} stages {s['num_stages']}: {ms}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
