"""Host synchronisations of a probed forward on the CUDA code path, counted on CPU.

Runs a tiny random-init Hugging Face model (built here from its config: the package alone, no
test code) under ``attach(model, ProbeConfig(backend="triton"))`` with Triton's interpreter
(``TRITON_INTERPRET=1``, set here before triton is imported), so every attention layer takes
the path CUDA takes: key ranges from the padding mask, the fused kernel, the reduction into the
accumulator; then the LM head and the batch's end. ``rows.host_shortcuts`` is switched off, so
the op sequence is the GPU's. Two interceptors see every operation:

* a ``TorchDispatchMode`` (aten ops): ``_local_scalar_dense`` (``.item()``, ``bool(t)``,
  ``int(t)``, ``float(t)``), the ops whose output shape depends on values (``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats, indexing by a bool
  tensor), and copies to another device;
* a ``TorchFunctionMode`` (Python calls): the copies to the host that make no aten op on CPU
  (``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``; a device read off a tensor is a
  move within that device, a device named ``cpu`` a move to the host);

and ``torch.cuda.synchronize`` is wrapped. Each synchronisation is put where the innermost
frame of peakprobe or transformers that made it lives: ``hooks`` (the glue), ``layer`` (an
attention layer's statistics), ``lm_head``, ``batch_end`` (after the forward), or ``model``
(transformers' own code, with or without peakprobe). Triton's interpreter (its CPU emulation
of a launch) is left out.

    python benchmarks/sync_audit.py [--arch llama|gemma2] [--backend triton|torch] [--json]

prints ``syncs_per_forward=`` (peakprobe's synchronisations inside one forward: hooks, layers,
LM head) and ``d2h_per_batch=`` (peakprobe's in one ``run_batch``, its end included), measured
on a second batch (device tables are built once per device, on the first). Without triton it
says so in one line and audits the torch path. ``--cuda`` (on a GPU, ``gpu_check.sh``) runs a
probed forward and the engine at larger shapes under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import peakprobe  # noqa: E402

PKG = str(Path(peakprobe.__file__).resolve().parent)
HOOKS = os.path.join(PKG, "hooks")
#: the function of peakprobe/hooks whose frame decides the phase (innermost first)
PHASE_OF = {"attention": "layer", "_kernel": "layer", "lm_head": "lm_head", "_lm_head_blocks": "lm_head",
            "_lm_kernel": "lm_head", "run_batch": "batch_end",
            "end_batch": "batch_end", "ranges_broken": "batch_end", "loss": "batch_end"}
FORWARD = ("hooks", "layer", "lm_head")  # inside one forward
#: aten ops whose output shape depends on tensor values (the host waits for them)
SHAPE_OPS = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
             "argwhere"}
D2H_CALLS = {"tolist", "numpy", "cpu", "__array__"}
_DEVICE = torch._C.TensorBase.__dict__["device"]


def _is_host(dev) -> bool:
    return dev is not None and torch.device(dev).type == "cpu"


class Audit:
    """Counts host synchronisations by kind and phase while active (a context manager).

    ``events`` lists (kind, op, phase): kind ``d2h`` (a copy to the host), ``shape`` (a
    value-dependent shape) or ``sync`` (an explicit synchronisation). ``phase`` set to a string
    forces every event into that phase (planted checks); None finds it from the stack."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.phase: str | None = None
        self._devices: list[torch.device] = []  # devices read off tensors (kept alive: ids stay unique)
        self._ids: set[int] = set()
        audit = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                audit._aten(func, args, kwargs)
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if getattr(func, "__self__", None) is _DEVICE:
                    audit._devices.append(out)
                    audit._ids.add(id(out))
                else:
                    audit._call(getattr(func, "__name__", ""), args, kwargs)
                return out

        self._modes = (Dispatch(), Function())

    # -- classification -------------------------------------------------------------------------
    def _where(self) -> str | None:
        """The phase of the op being made (None: Triton's interpreter, left out)."""
        frame = sys._getframe(3)
        owner = None
        while frame is not None:
            name = frame.f_code.co_filename
            if "triton" in name and "interpreter" in name:
                return None
            if owner is None and (name.startswith(PKG) or f"{os.sep}transformers{os.sep}" in name):
                owner = "peakprobe" if name.startswith(PKG) else "model"
            if owner == "peakprobe" and name.startswith(HOOKS):
                return self.phase or PHASE_OF.get(frame.f_code.co_name, "hooks")
            frame = frame.f_back
        return self.phase or owner or "outside"

    def _add(self, kind: str, op: str) -> None:
        phase = self._where()
        if phase is not None:
            self.events.append((kind, op, phase))

    def _aten(self, func, args, kwargs) -> None:
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self._add("d2h", name)
        elif name in SHAPE_OPS:
            self._add("shape", name)
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and (
                len(args) > 1 and isinstance(args[1], torch.Tensor) or func._overloadname == "Tensor"):
            if kwargs.get("output_size") is None:  # the output's length is the repeats' sum
                self._add("shape", name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ()):
                self._add("shape", f"{name}[bool]")
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device")
            if dst is not None and torch.device(dst) != src.device:
                self._add("d2h" if _is_host(dst) else "copy", name)

    def _call(self, name: str, args, kwargs) -> None:
        if name in D2H_CALLS:
            self._add("d2h", name)
        elif name == "to" and args and isinstance(args[0], torch.Tensor):
            dev = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, str | torch.device):
                    dev = a
            if dev is not None and id(dev) not in self._ids and _is_host(dev):
                self._add("d2h", "to(cpu)")

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> Audit:
        self._sync = torch.cuda.synchronize

        def synchronize(device=None):
            self._add("sync", "cuda.synchronize")
            if torch.cuda.is_available():
                self._sync(device)

        torch.cuda.synchronize = synchronize
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        torch.cuda.synchronize = self._sync

    def count(self, phases=None, kinds=None) -> int:
        return sum(1 for k, _, p in self.events if (phases is None or p in phases)
                   and (kinds is None or k in kinds))

    def by_phase(self) -> dict[str, dict[str, int]]:
        out: dict[str, Counter] = {}
        for kind, op, phase in self.events:
            out.setdefault(phase, Counter())[f"{kind}:{op}"] += 1
        return {p: dict(c) for p, c in sorted(out.items())}


def tiny_model(arch: str = "llama"):
    """A 2-layer random-init model: ``llama`` (grouped-query heads 4/2, head dim 16) or
    ``gemma2`` (softcapped attention and logits, a sliding window)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "gemma2":
        cfg = Gemma2Config(head_dim=16, sliding_window=8, attn_logit_softcapping=20.0,
                           final_logit_softcapping=10.0, query_pre_attn_scalar=16, **common)
    else:
        raise SystemExit(f"sync_audit: unknown --arch {arch!r} (llama, gemma2)")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def audit(arch: str = "llama", backend: str = "triton", batch: int = 2, length: int = 24) -> dict:
    """Probe two batches of ``arch`` (left-padded: the ranges come from a mask tensor); the
    second under the ``Audit``. Returns the counts."""
    from peakprobe.config import ProbeConfig
    from peakprobe.hooks import attach
    from peakprobe.probes import rows

    model = tiny_model(arch)
    ids = torch.randint(1, 90, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    counted = Audit()
    shortcuts, rows.host_shortcuts = rows.host_shortcuts, lambda device: False  # the GPU's op sequence
    try:
        with attach(model, ProbeConfig(backend=backend)) as probe:
            probe.run_batch(ids, mask)  # first: tables built once per device, not per batch
            calls = probe.n_attention_calls
            with counted:
                loss = probe.run_batch(ids, mask)
            calls = probe.n_attention_calls - calls
    finally:
        rows.host_shortcuts = shortcuts
    return {
        "arch": arch, "backend": backend, "attention_calls": calls, "loss": loss,
        "syncs_per_forward": counted.count(FORWARD),
        "d2h_per_batch": counted.count((*FORWARD, "batch_end")),
        "model_syncs": counted.count(("model",)),
        "by_phase": counted.by_phase(),
    }


def cuda_check(layers: int = 4, batch: int = 4, seq: int = 512, heads: int = 8, dim: int = 64,
               vocab: int = 50304) -> dict:
    """On a GPU, under ``torch.cuda.set_sync_debug_mode("error")`` (which raises at the first
    host synchronisation): a tiny model's whole probed forward (hooks, layers, LM head), then
    the engine's attention layers (causal; padded, with a mask tensor) and LM head at larger
    shapes. Returns the first error (None: no synchronisation)."""
    from peakprobe.config import ProbeConfig
    from peakprobe.hooks import attach
    from peakprobe.hooks.engine import SiteStats, lm_targets
    from peakprobe.probes import MaskSpec

    dev = torch.device("cuda")
    model = tiny_model("llama").to(dev, torch.bfloat16)
    ids = torch.randint(1, 90, (2, 64), device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(batch, heads, seq, dim, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pad = torch.ones(batch, seq, dtype=torch.bool, device=dev)
    pad[1:, :37] = False  # left padding
    mask = (torch.ones(seq, seq, dtype=torch.bool, device=dev).tril() & pad[:, None, :]).unsqueeze(1)
    logits = torch.randn(batch, seq, vocab, generator=g, device=dev, dtype=torch.bfloat16)
    kept, target = lm_targets(torch.randint(0, vocab, (batch, seq), generator=g, device=dev), pad.long())
    stats = SiteStats(ProbeConfig())
    stats.attention(0, q, k, None, spec=MaskSpec(), scaling=dim ** -0.5)  # warm-up: tables, compile
    stats.lm_head(logits, kept, target)
    error = None
    with attach(model) as probe:
        probe.run_batch(ids)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)  # hooks, every layer, the LM head
            for layer in range(layers):
                spec = MaskSpec() if layer % 2 == 0 else MaskSpec(mask=mask)
                stats.attention(layer, q, k, None, spec=spec, scaling=dim ** -0.5, row_valid=pad)
            stats.lm_head(logits, kept, target)
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        probe.stats.end_batch()
    return {"syncs_per_forward": 0 if error is None else "at least 1", "error": error,
            "kernel": stats._kernel(q, k, MaskSpec(), {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "gemma2"))
    parser.add_argument("--backend", default=None, choices=("triton", "torch"),
                        help="the probes' path (default: triton when installed, the CUDA path)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--cuda", action="store_true",
                        help="on a GPU: under torch.cuda.set_sync_debug_mode('error')")
    args = parser.parse_args(argv)
    if args.cuda:
        out = cuda_check()
        print(json.dumps(out) if args.json else
              f"cuda: syncs_per_forward={out['syncs_per_forward']} (a probed forward, the engine's "
              f"layers and LM head; kernel path: {out['kernel']})"
              + (f"; {out['error']}" if out["error"] else ""))
        return 0 if out["error"] is None else 1
    backend = args.backend
    if backend is None:
        backend = "triton" if importlib.util.find_spec("triton") else "torch"
        if backend == "torch":
            print("sync_audit: the CUDA path's kernel needs triton (pip install triton); "
                  "auditing the torch path")
    out = audit(args.arch, backend)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"syncs_per_forward={out['syncs_per_forward']} d2h_per_batch={out['d2h_per_batch']} "
          f"({out['arch']}, backend {out['backend']}, {out['attention_calls']} attention calls)")
    print("by phase: " + json.dumps(out["by_phase"]))
    print(f"model_syncs={out['model_syncs']} (transformers' own code, with or without peakprobe)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
