"""Bytes the LM head's statistics move per logit, counted on CPU: the kernel path against the
torch path, on the same logits.

``SiteStats.lm_head`` runs on a batch of logits (B, T, V) of a Pythia vocabulary under a
``TorchDispatchMode`` that adds up, for every aten op, the bytes of its tensor inputs (read)
and of its outputs (written); ops whose output is a view of an input move nothing and are left
out. The Triton kernel's launch is counted from what the kernel reads and writes: every logit
once, plus per position its first logit, its target's logit and its target id, and the 8
float32 of its record. Triton's interpreter (``TRITON_INTERPRET=1``, set here) runs the kernel
on CPU; its own emulation ops are left out. The count is an upper bound for elementwise torch
ops (a broadcast input counts at its broadcast size).

    python benchmarks/lm_head_bytes.py [--batch 2] [--seq 32] [--vocab 50304]

prints ``lm_head_bytes_per_logit=<kernel path>`` per logit dtype (bf16, fp32), with the torch
path's figure and the ratio. Without triton: the torch path alone, and a line that says so.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from peakprobe.config import ProbeConfig  # noqa: E402
from peakprobe.hooks.engine import SiteStats, lm_targets  # noqa: E402


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _interpreted() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "triton" in name and ("interpreter" in name or "jit.py" in name):
            return True
        frame = frame.f_back
    return False


class Bytes(TorchDispatchMode):
    """Bytes read and written by aten ops (views left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _interpreted():
            return out
        inputs = list(_tensors(args)) + [t for k, v in kwargs.items() if k != "out" for t in _tensors(v)]
        outputs = list(_tensors(out))
        ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        inplace = func._schema.name.endswith("_") or "out" in kwargs
        if outputs and not inplace and all(t.untyped_storage().data_ptr() in ptrs for t in outputs):
            return out  # a view: nothing moves
        self.read += sum(_nbytes(t) for t in inputs)
        self.written += sum(_nbytes(t) for t in outputs)
        return out


def count(logits: torch.Tensor, kept: torch.Tensor, target: torch.Tensor, backend: str) -> dict:
    """Bytes moved by one ``SiteStats.lm_head`` call on ``backend`` (after a warm-up call)."""
    stats = SiteStats(ProbeConfig(backend=backend))
    stats.lm_head(logits, kept, target)  # warm-up (tables, workspace)
    stats.end_batch()
    kernel = {"read": 0, "written": 0, "launches": 0}
    took = stats._lm_kernel(logits)
    if took:
        from peakprobe.probes import triton_lm_head as lm

        launch = lm.lm_head_kernel

        class Counted:  # the launch, counted from what the kernel reads and writes
            def __getitem__(self, grid):
                def run(z, tg, out, rows, v, *rest, **kw):
                    kernel["read"] += _nbytes(z) + rows * (2 * z.element_size() + tg.element_size())
                    kernel["written"] += _nbytes(out)
                    kernel["launches"] += 1
                    return launch[grid](z, tg, out, rows, v, *rest, **kw)
                return run

        lm.lm_head_kernel = Counted()
    mode = Bytes()
    try:
        with mode:
            stats.lm_head(logits, kept, target)
    finally:
        if took:
            lm.lm_head_kernel = launch
    total = mode.read + mode.written + kernel["read"] + kernel["written"]
    return {"backend": backend, "kernel_path": took, "torch_read": mode.read, "torch_written": mode.written,
            "kernel_read": kernel["read"], "kernel_written": kernel["written"],
            "bytes_per_logit": total / logits.numel()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    has_triton = importlib.util.find_spec("triton") is not None
    if not has_triton:
        print("lm_head_bytes: the kernel path needs triton (pip install triton); the torch path alone")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    kept, target = lm_targets(ids, None)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(args.batch, args.seq, args.vocab, generator=g) * 3).to(dtype)
        torch_path = count(logits, kept, target, "torch")
        kernel = count(logits, kept, target, "triton") if has_triton else None
        results.append({"dtype": str(dtype).replace("torch.", ""), "torch": torch_path, "kernel": kernel})
        name = results[-1]["dtype"]
        if kernel is None:
            print(f"logits {name}: torch path {torch_path['bytes_per_logit']:.1f} bytes per logit")
            continue
        print(f"lm_head_bytes_per_logit={kernel['bytes_per_logit']:.2f} (logits {name}, kernel path; "
              f"torch path {torch_path['bytes_per_logit']:.1f}, {torch_path['bytes_per_logit'] / kernel['bytes_per_logit']:.0f}x "
              f"more; {args.batch} x {args.seq} positions x {args.vocab} vocabulary)")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
