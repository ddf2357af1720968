"""Host synchronisations on the CUDA code path, counted on CPU.

Runs a tiny Hugging Face model under ``attach(model, ProbeConfig(backend="triton"))`` with
Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported), so every
attention layer takes the path CUDA takes: key ranges, the fused kernel, the reduction into the
accumulator. A ``TorchDispatchMode`` sees every aten op and counts the ones that would make the
host wait for a GPU: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``),
``aten.nonzero`` and copies to another device. Ops are attributed to the attention layer, the
LM head or the batch's end (where one copy per batch is allowed: the batch's loss and the
kernel's range check).

    python benchmarks/sync_audit.py [--arch llama_gqa] [--json]

prints ``syncs_per_layer=<n> ops_per_layer=<n>`` (syncs and ops per attention layer, on a
second batch: tables are built once per device on the first), then the LM head's and the batch
end's. ``model`` ops are the model's own (transformers' mask building may read the padding
mask on the host, with or without peakprobe). On CPU a copy between devices cannot happen, so
the device-changing copies are checked on a GPU by ``benchmarks/gpu_check.sh``
(``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SYNC_OPS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero"}


def _from_interpreter(depth: int = 12) -> bool:
    """Whether the op was issued by Triton's interpreter (its emulation of a kernel launch)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if "triton" in frame.f_code.co_filename and "interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Audit(TorchDispatchMode):
    """Counts aten ops and host syncs per phase (``phase`` is set by the wrapped engine)."""

    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.seen: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _from_interpreter():  # Triton's CPU emulation of the launch, not a CUDA op
            self.ops["interpreter"] += 1
            return func(*args, **kwargs)
        self.ops[self.phase] += 1
        sync = name in SYNC_OPS
        if name in ("_to_copy", "copy_", "to"):
            src = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            dst = kwargs.get("device")
            sync |= dst is not None and src is not None and torch.device(dst) != src
        if sync:
            self.syncs[self.phase] += 1
            self.seen.setdefault(self.phase, Counter())[name] += 1
        return func(*args, **kwargs)


def audit(arch: str = "llama_gqa", batch: int = 2, length: int = 24) -> dict:
    """Probe one batch of ``arch`` on the CUDA path under the audit; the counts per phase."""
    from conftest import tiny_model

    from peakprobe.config import ProbeConfig
    from peakprobe.hooks import attach
    from peakprobe.hooks.engine import SiteStats
    from peakprobe.probes import rows

    model = tiny_model(arch, dtype=torch.float32)
    ids = torch.randint(1, 90, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the ranges come from a mask tensor
    mode = Audit()
    # the GPU's op sequence: no read of a value to skip work (free on CPU, a stall on a GPU)
    shortcuts, rows.host_shortcuts = rows.host_shortcuts, lambda device: False
    layers = {"n": 0, "kernel": 0}
    attention, lm_head = SiteStats.attention, SiteStats.lm_head

    def counted_attention(self, *args, **kwargs):
        mode.phase = "layer"
        layers["n"] += 1
        layers["kernel"] += int(self._kernel(args[1], args[2], kwargs["spec"], kwargs))
        try:
            return attention(self, *args, **kwargs)
        finally:
            mode.phase = "model"

    def counted_lm_head(self, *args, **kwargs):
        mode.phase = "lm_head"
        try:
            return lm_head(self, *args, **kwargs)
        finally:
            mode.phase = "batch_end"

    try:
        with attach(model, ProbeConfig(backend="triton")) as probe:
            probe.run_batch(ids, mask)  # first: tables built once per device, not per layer
            SiteStats.attention, SiteStats.lm_head = counted_attention, counted_lm_head
            with mode:
                mode.phase = "model"
                probe.run_batch(ids, mask)
    finally:
        SiteStats.attention, SiteStats.lm_head = attention, lm_head
        rows.host_shortcuts = shortcuts
    n = max(1, layers["n"])
    return {
        "arch": arch,
        "layers": layers["n"],
        "kernel_layers": layers["kernel"],
        "syncs_per_layer": mode.syncs["layer"] / n,
        "ops_per_layer": mode.ops["layer"] / n,
        "lm_head_syncs": mode.syncs["lm_head"],
        "lm_head_ops": mode.ops["lm_head"],
        "batch_end_syncs": mode.syncs["batch_end"],
        "interpreter_ops": mode.ops["interpreter"],
        "sync_ops": {k: dict(v) for k, v in mode.seen.items()},
    }


def cuda_check(layers: int = 4, batch: int = 4, seq: int = 512, heads: int = 8, dim: int = 64,
               vocab: int = 50304) -> dict:
    """On a GPU: attention layers (causal; padded, with a mask tensor) and the LM head through
    the statistics engine under ``torch.cuda.set_sync_debug_mode("error")``, which raises at the
    first host synchronisation. Returns the layers and syncs seen (0, or the error)."""
    from peakprobe.config import ProbeConfig
    from peakprobe.hooks.engine import SiteStats, lm_targets
    from peakprobe.probes import MaskSpec

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(batch, heads, seq, dim, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pad = torch.ones(batch, seq, dtype=torch.bool, device=dev)
    pad[1:, :37] = False  # left padding
    causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()
    mask = (causal & pad[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
    logits = torch.randn(batch, seq, vocab, generator=g, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), generator=g, device=dev)
    kept, target = lm_targets(ids, pad.long())
    stats = SiteStats(ProbeConfig())
    stats.attention(0, q, k, None, spec=MaskSpec(), scaling=dim ** -0.5)  # warm-up: tables, compile
    stats.lm_head(logits, kept, target)
    torch.cuda.synchronize()
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(layers):
            spec = MaskSpec() if layer % 2 == 0 else MaskSpec(mask=mask)
            stats.attention(layer, q, k, None, spec=spec, scaling=dim ** -0.5, row_valid=pad)
        stats.lm_head(logits, kept, target)
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"layers": layers, "syncs_per_layer": 0 if error is None else "at least 1", "error": error,
            "kernel": stats._kernel(q, k, MaskSpec(), {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama_gqa")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--cuda", action="store_true",
                        help="on a GPU: the engine under torch.cuda.set_sync_debug_mode('error')")
    args = parser.parse_args(argv)
    if args.cuda:
        out = cuda_check()
        print(json.dumps(out) if args.json else
              f"cuda: syncs_per_layer={out['syncs_per_layer']} over {out['layers']} layers and the "
              f"LM head (kernel path: {out['kernel']}){'; ' + out['error'] if out['error'] else ''}")
        return 0 if out["error"] is None else 1
    out = audit(args.arch)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"syncs_per_layer={out['syncs_per_layer']:g} ops_per_layer={out['ops_per_layer']:.0f}")
    print(f"lm_head_syncs={out['lm_head_syncs']} lm_head_ops={out['lm_head_ops']} "
          f"batch_end_syncs={out['batch_end_syncs']} (one copy per batch is allowed)")
    print(f"{out['kernel_layers']} of {out['layers']} attention calls took the kernel path ({out['arch']}); "
          f"{out['interpreter_ops']} ops of Triton's interpreter (its CPU emulation) left out")
    if out["sync_ops"]:
        print("syncs by op: " + json.dumps(out["sync_ops"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
