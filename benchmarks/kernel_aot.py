"""Compile the attention-statistics kernel for sm_90 (Hopper) without a GPU; report registers,
spills and whether its QK^T tiles run on the tensor cores.

Every constexpr variant ``triton_kernel.kernel_site_sums`` can launch on a GPU is compiled
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` under its own launch
configuration (``triton_kernel.compile_options``): q/k dtype (bf16, fp16, fp32) x padded head
dim (16, 32, 64, 128, 256 as supported, and a head dim that is not a power of two, which masks
the head dimension) x softcapping. The unit strides of contiguous head dims and the 16-byte
alignments a launch specialises on are given as the launcher would. The PTX then goes through
the ptxas triton itself runs for sm_90 (shipped in the wheel; ``-v`` with triton's own flags:
registers, spill stores and loads) and the cubin through its cuobjdump (tensor-core MMA instructions,
HGMMA / HMMA, in the SASS). From the SASS and the launch:

* ``instr_per_score``: the SASS instructions of the unmasked key loop's body (the smallest loop,
  from a backward branch to its target, that holds an MMA) over the scores one thread handles
  per iteration (BLOCK_M x BLOCK_N / (32 num_warps));
* ``ctas_per_sm``: programs resident per sm_90 SM, the least of the register file (65,536 per
  SM, allocated per warp in units of 256), shared memory (228 KiB per SM, 1 KiB reserved per
  block), 64 warps and 32 blocks.

One line per configuration:

    config=<name> regs=<n> spill_bytes=<n> mma=<yes|no> instr_per_score=<x> ctas_per_sm=<n>

    python benchmarks/kernel_aot.py                 # every configuration (minutes of CPU)
    python benchmarks/kernel_aot.py --only bf16     # names containing "bf16"
    python benchmarks/kernel_aot.py --quick         # one per launch and constexpr class
    python benchmarks/kernel_aot.py --json out.json

Run without TRITON_INTERPRET (the interpreter cannot compile). Exit status 1 when a
configuration spills, has no MMA, or needs more shared memory than an sm_90 block has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: the integer arguments a launch passes (i32) and which of them are strides it aligns
_ALIGNED_INTS = ("sqb", "sqh", "sqt", "skb", "skh", "skt")
_POINTER_TYPES = {
    "start_ptr": "*i32", "end_ptr": "*i32", "rowv_ptr": "*u8", "sink_ptr": "*fp32",
    "out_ptr": "*fp32", "hist_ptr": "*i32", "curves_ptr": "*fp32", "cell_base_ptr": "*i32",
    "lo_ptr": "*i32", "bgrid_ptr": "*fp32",
}  # fmt: skip
EXTRA: dict = {}  # more compile options (experiments)
#: the most shared memory one block may use on sm_90 (227 KiB)
SM90_SHARED = 232448
_FLOAT_ARGS = ("scaling", "softcap", "hist_lo0", "hist_scale0", "hist_lo1", "hist_scale1")


@dataclass(frozen=True)
class Config:
    name: str
    dtype: torch.dtype
    head_dim: int
    softcap: bool


def configs(quick: bool = False) -> list[Config]:
    """Every variant the host can launch on a GPU: for each supported (dtype, padded head dim)
    of ``triton_kernel`` (its launch configurations), the padded dim itself, one head dim that
    pads to it (the head-dim mask), and below 64 the small paddings 16 and 32; each without and
    with softcapping. ``quick``: the padded dims 64, 128, 256 only, plus the masked head dims
    for bf16 (one configuration per launch and constexpr class)."""
    from peakprobe.probes import triton_kernel as tk

    out = []
    for dname, dtype in DTYPES.items():
        dims = []
        for width, pd in sorted(tk._CONFIGS):
            if width == dtype.itemsize:
                if quick:
                    dims += ([pd * 3 // 4] if dname == "bf16" else []) + [pd]
                else:
                    dims += ([16, 32] if pd == 64 else []) + [pd * 3 // 4, pd]
        for d in dims:
            for softcap in (False, True):
                out.append(Config(f"{dname}-d{d}{'-softcap' if softcap else ''}", dtype, d, softcap))
    return out


def _tool(name: str) -> Path:
    """A CUDA tool of the triton wheel; ptxas is the one triton itself runs for sm_90."""
    import triton

    if name == "ptxas":
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path)
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def tools_available() -> bool:
    """ptxas and cuobjdump ship in the triton wheel (Linux x86-64 / aarch64)."""
    return _tool("ptxas").exists() and _tool("cuobjdump").exists()


def compile_config(cfg: Config) -> dict:
    """Compile one configuration; its registers, spill bytes, MMA presence and launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from peakprobe.probes import triton_kernel as tk
    from peakprobe.probes.triton_site import site_kernel

    if tk.INTERPRETED:
        raise SystemExit("kernel_aot: run without TRITON_INTERPRET=1 (the interpreter cannot compile)")
    consts, options = tk.compile_options(cfg.dtype, cfg.head_dim)
    consts["SOFTCAP"] = cfg.softcap
    consts.update(sqd=1, skd=1)  # contiguous head dims: the launcher specialises stride 1
    names = site_kernel.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ("q_ptr", "k_ptr"):
            sig[n] = "*" + _TRITON_TYPE[cfg.dtype]
        elif n == "k_desc":  # the key tiles' TMA descriptor, as the launcher builds it
            sig[n] = f"tensordesc<{_TRITON_TYPE[cfg.dtype]}[1, 1, {consts['BLOCK_N']}, {consts['BLOCK_D']}]>"
        elif n in _POINTER_TYPES:
            sig[n] = _POINTER_TYPES[n]
        elif n in _FLOAT_ARGS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") or n in _ALIGNED_INTS]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(site_kernel, sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**options, **EXTRA})
    regs, spills = _ptxas_usage(kernel.asm["ptx"])
    sass = _sass(kernel.asm["cubin"])
    mma = bool(re.search(r"\b(HGMMA|HMMA|WGMMA)\b", sass))
    loop = fast_loop_instructions(sass)
    scores = consts["BLOCK_M"] * consts["BLOCK_N"] / (32 * options["num_warps"])
    return {
        "config": cfg.name, "regs": regs, "spill_bytes": spills, "mma": mma,
        "loop_instructions": loop, "instr_per_score": loop / scores if loop else None,
        "ctas_per_sm": ctas_per_sm(regs, options["num_warps"], kernel.metadata.shared),
        "block_m": consts["BLOCK_M"], "block_n": consts["BLOCK_N"], "block_d": consts["BLOCK_D"],
        "num_warps": options["num_warps"], "num_stages": options["num_stages"],
        "shared_bytes": kernel.metadata.shared,
    }  # fmt: skip


def fast_loop_instructions(sass: str) -> int | None:
    """SASS instructions in the unmasked key loop: the smallest loop (a backward branch and
    its target) that holds a tensor-core MMA; None when no loop holds one."""
    addr = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
    code = [(int(m.group(1), 16), m.group(2)) for m in addr.finditer(sass)]
    best = None
    for pc, text in code:
        jump = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if not jump or int(jump.group(1), 16) >= pc:
            continue
        body = [t for a, t in code if int(jump.group(1), 16) <= a <= pc]
        if any(re.search(r"\b(HGMMA|HMMA)\b", t) for t in body) and (best is None or len(body) < best):
            best = len(body)
    return best


def ctas_per_sm(regs: int, num_warps: int, shared: int) -> int:
    """Blocks resident on one sm_90 SM (registers, shared memory, warps, blocks)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (65536 // per_warp) // num_warps
    by_shared = (233472 // (shared + 1024)) if shared else 32
    return max(0, min(by_regs, by_shared, 64 // num_warps, 32))


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) from ``ptxas -v`` with triton's own flags."""
    target = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(_tool("ptxas")), "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={target}", str(src), "-o", str(Path(tmp) / "k.o")]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"ptxas failed ({run.returncode}): {(run.stderr or run.stdout)[-2000:]}")
        log = run.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return regs, int(stores.group(1) if stores else 0) + int(loads.group(1) if loads else 0)


def _sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(_tool("cuobjdump")), "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip


def line(r: dict) -> str:
    ips = f"{r['instr_per_score']:.1f}" if r["instr_per_score"] is not None else "none"
    return (f"config={r['config']} regs={r['regs']} spill_bytes={r['spill_bytes']} "
            f"mma={'yes' if r['mma'] else 'no'} instr_per_score={ips} ctas_per_sm={r['ctas_per_sm']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="compile the configurations whose name contains this")
    parser.add_argument("--quick", action="store_true",
                        help="one configuration per launch and constexpr class (tests)")
    parser.add_argument("--json", default=None, help="write the results (with launches) here")
    parser.add_argument("--verbose", action="store_true", help="also print each launch configuration")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_aot: unset TRITON_INTERPRET (the interpreter cannot compile)", file=sys.stderr)
        return 2
    if not tools_available():
        print("kernel_aot: triton's ptxas / cuobjdump not found", file=sys.stderr)
        return 2
    results = []
    for cfg in configs(args.quick):
        if args.only and args.only not in cfg.name:
            continue
        r = compile_config(cfg)
        results.append(r)
        print(line(r), flush=True)
        if args.verbose:
            print(f"  block_m={r['block_m']} block_n={r['block_n']} block_d={r['block_d']} "
                  f"num_warps={r['num_warps']} num_stages={r['num_stages']} "
                  f"shared_bytes={r['shared_bytes']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    ok = all(r["spill_bytes"] == 0 and r["mma"] and r["shared_bytes"] <= SM90_SHARED for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
