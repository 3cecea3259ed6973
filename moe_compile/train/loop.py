"""The compiled training loop behind ``moe-compile train`` (one call per rank)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..mesh import MeshSpec


@dataclass
class TrainConfig:
    steps: int = 20
    mesh: str = ""
    model: str = "tiny"  # tiny | olmoe | mixtral | qwen2_moe
    layers: int = 2
    d_model: int = 64
    experts: int = 8
    top_k: int = 2
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    capacity_factor: float | None = None
    metrics_jsonl: str | None = None
    data: str | None = None
    log_every: int = 1


def build_model(cfg: TrainConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    if cfg.model == "tiny":
        from ..models import TinyMoEConfig, TinyMoELM

        return TinyMoELM(TinyMoEConfig(vocab_size=256, d_model=cfg.d_model, n_layers=cfg.layers,
                                       num_experts=cfg.experts, top_k=cfg.top_k, max_seq_len=max(256, cfg.seq_len)))
    from ..models import tiny_hf_model

    return tiny_hf_model(cfg.model, seed=cfg.seed, layers=cfg.layers, d=cfg.d_model, experts=cfg.experts,
                         top_k=cfg.top_k, vocab=256)


def global_grad_norm(cm: Any) -> float:
    """L2 norm of the full gradient, each logical parameter counted once: dense gradients are
    replicated; expert shards are summed over the EP-MP group (not over their ep_dp replicas)."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, p in cm.model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if cm.is_expert_param(name):
            expert += sq
        else:
            dense += sq
    if cm.groups is not None and cm.program.ep_size > 1:
        dist.all_reduce(expert, group=cm.groups.ep_mp)
    return math.sqrt(float(dense + expert))


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from .. import moe_compile
    from .data import ByteFileStream, SyntheticStream

    mesh = MeshSpec.parse(cfg.mesh) if cfg.mesh else MeshSpec()
    cm = moe_compile(build_model(cfg), mesh, capacity_factor=cfg.capacity_factor)
    spec = cm.program.mesh
    dp_rank = spec.dense_coords(rank)[1]
    stream = (ByteFileStream(cfg.data, cfg.seq_len, cfg.batch_size, cfg.seed) if cfg.data
              else SyntheticStream(256, cfg.seq_len, cfg.batch_size, cfg.seed))
    opt = torch.optim.AdamW(cm.parameters(), lr=cfg.lr, weight_decay=0.0)
    leader = rank == 0
    sink = open(cfg.metrics_jsonl, "w") if (leader and cfg.metrics_jsonl) else None
    tokens_per_step = cfg.batch_size * cfg.seq_len * spec.dp * spec.cp
    losses, times = [], []
    start = time.time()
    try:
        for step in range(cfg.steps):
            t0 = time.time()
            batch = stream.batch(step, dp_rank)
            loss = cm(input_ids=batch, labels=batch).loss
            loss.backward()
            gnorm = global_grad_norm(cm)
            opt.step()
            opt.zero_grad(set_to_none=False)
            mean_loss = loss.detach().clone()
            if world > 1:
                dist.all_reduce(mean_loss)
                mean_loss /= world
            dt = time.time() - t0
            losses.append(mean_loss.item())
            times.append(dt)
            if leader:
                rec = {"step": step + 1, "loss": losses[-1], "grad_norm": gnorm, "tokens": tokens_per_step,
                       "seconds": dt}
                if sink:
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                    print(f"step {step + 1:>4}/{cfg.steps} | loss {losses[-1]:.4f} | grad_norm {gnorm:.3f} | "
                          f"{tokens_per_step / dt:,.0f} tok/s", flush=True)
    finally:
        if sink:
            sink.close()
    total = time.time() - start
    steady = times[1:] or times
    return {
        "model": cfg.model,
        "mesh": str(spec),
        "ranks": world,
        "steps": cfg.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "seconds": total,
        "compile_and_first_step_seconds": times[0] if times else None,
        "step_seconds": sum(steady) / len(steady) if steady else None,
        "tokens_per_second": tokens_per_step * len(steady) / sum(steady) if steady else None,
        "config": asdict(cfg),
    }


def print_summary(s: dict[str, Any], out=sys.stdout) -> None:
    print(
        f"done: {s['model']} on mesh {s['mesh']} ({s['ranks']} ranks), {s['steps']} steps in {s['seconds']:.1f}s | "
        f"loss {s['first_loss']:.4f} → {s['final_loss']:.4f} | step {s['step_seconds'] * 1000:.0f} ms | "
        f"{s['tokens_per_second']:,.0f} tok/s (first step incl. compile: {s['compile_and_first_step_seconds']:.1f}s)",
        file=out, flush=True,
    )
