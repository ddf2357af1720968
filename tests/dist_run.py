"""Test helper, and a torchrun script: tiny GPT-NeoX and Llama (GQA) models probed by a Monitor
under DDP, FSDP2 or tensor parallel on CPU (gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_run.py MODE ARCH OUT

MODE is ddp, fsdp, tp or tp-vocab (tensor parallel with a vocab-parallel LM head); ARCH neox or
llama. The Monitor probes step 0 (the initialised model) into OUT/run; rank 0 prints a line.
``python tests/dist_run.py single ARCH OUT`` writes the single-process reference. The test
module starts the same ``worker`` with ``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from peakprobe.config import SweepConfig
from peakprobe.data import EvalData, token_hash
from peakprobe.integrations import Monitor, live_config

VOCAB = 61
WINDOW = 16
N_WINDOWS = 6  # 3 batches of 2: ranks get 1 and 2 (FSDP2 pads the first)
BATCH = 2


def tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    """2 layers; GPT-NeoX 4 heads, or Llama 4 query heads over 2 key/value heads (GQA)."""
    torch.manual_seed(seed)
    if arch == "neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
        model = GPTNeoXForCausalLM(cfg)
    elif arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown arch {arch}")
    model.config._attn_implementation = "eager"
    return model.eval()


def eval_data() -> EvalData:
    g = torch.Generator().manual_seed(2)
    half = torch.randint(1, VOCAB, (N_WINDOWS, WINDOW // 2), generator=g)
    ids = torch.cat([half, half], dim=1)  # (N, T): the second half repeats the first
    return EvalData(ids, torch.ones_like(ids), "repeat-windows", token_hash(ids))


def config() -> SweepConfig:
    return SweepConfig(batch_size=BATCH, probe=live_config(attribution=False).probe,
                       attribution=live_config(attribution=False).attribution)


def layers(model):
    return model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers


def tp_plan(model, vocab_parallel: bool) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(layers(model)):
        if hasattr(model, "gpt_neox"):
            pre = f"gpt_neox.layers.{i}.attention"
            plan[f"{pre}.query_key_value"] = ColwiseParallel()  # per head [q, k, v]: contiguous heads
            plan[f"{pre}.dense"] = RowwiseParallel()
        else:
            pre = f"model.layers.{i}.self_attn"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{pre}.{name}"] = ColwiseParallel()
            plan[f"{pre}.o_proj"] = RowwiseParallel()
    if vocab_parallel:
        head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
        plan[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def wrap(model, mode: str):
    """The model as ``mode`` spreads it over the process group."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, tp_plan(model, mode == "tp-vocab"))


def probe(mode: str, arch: str, out: Path, *, fail_rank: int | None = None, count: bool = False) -> dict:
    """Probe step 0 (and, with ``fail_rank``, step 2 with that rank's statistics raising)."""
    model = wrap(tiny(arch), mode) if mode != "single" else tiny(arch)
    monitor = Monitor(eval_data(), out / "run", total_steps=2, n_points=2, config=config(), timeout=60)
    monitor.watch(model)
    counts = {"all_reduce": 0, "all_gather": 0, "all_gather_object": 0}
    if count:
        for name in counts:
            real = getattr(dist, name)

            def counted(*a, _real=real, _name=name, **k):
                counts[_name] += 1
                return _real(*a, **k)

            setattr(dist, name, counted)
    monitor.step(0)
    if fail_rank is not None:
        from peakprobe.hooks.engine import SiteStats

        if dist.get_rank() == fail_rank:
            def broken(self, *a, **k):
                raise ValueError("planted failure in the statistics")

            SiteStats.attention = broken
        monitor.step(2)
    return {"done": sorted(monitor.done), "failed": monitor.failed, "all_reduces": monitor.all_reduces,
            "counts": counts, "layout": monitor.layout.describe()}


def worker(rank: int, world: int, port: int, mode: str, arch: str, out: str, fail_rank, count) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        got = probe(mode, arch, Path(out), fail_rank=fail_rank, count=count)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, arch, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode != "single":
        dist.init_process_group("gloo")
    got = probe(mode, arch, out)
    if mode == "single" or dist.get_rank() == 0:
        print(f"{mode} {arch}: probes at steps {got['done']}, {got['all_reduces']} all-reduces per probe, "
              f"layout {got['layout']}", flush=True)
    if mode != "single":
        dist.destroy_process_group()
