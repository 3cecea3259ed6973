"""The compiled training loop behind ``moe-compile train`` (one call per rank).

    cm  = moe_compile(model in fp32 | bf16, mesh, mxfp8="experts" for --precision mxfp8)
    opt = OLMoDDPOptimizer(cm)                           FP32 main weights, ZeRO-1 per family
    resume: load_checkpoint(latest in --ckpt)            under the current mesh (topology portability)
    each step: cm.train_step over m microbatches (pipeline schedule at pp > 1) → opt.step() → zero_grad
               every --save-every steps: save_checkpoint (atomic)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import OptionError
from ..mesh import MeshSpec
from ..models import TinyMoEConfig
from ..options import positive_finite, schedule_without_pipeline
from .data import check_data_file
from .optimizer import OLMoDDPOptimizer, StepResult

PRECISIONS = ("fp32", "bf16", "mxfp8")


@dataclass
class TrainConfig:
    steps: int = 20  # train until this many steps are done (a resumed run continues to it)
    mesh: str = ""
    model: str = "tiny"  # tiny | olmoe | mixtral | qwen2_moe
    layers: int = 2
    d_model: int = 64
    experts: int = 8
    top_k: int = 2
    batch_size: int = 4  # sequences per microbatch
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    capacity_factor: float | None = None
    metrics_jsonl: str | None = None
    data: str | None = None
    log_every: int = 1
    precision: str = "fp32"  # fp32 | bf16 (model in BF16, FP32 main weights) | mxfp8 (routed experts)
    grad_accum: int = 1  # m: microbatches per optimizer step (--microbatches)
    schedule: str = "1f1b"  # pipeline schedule when the mesh has pp > 1 (another one at pp = 1 is refused)
    activation_checkpointing: str | None = None  # None | selective | moe | full (CompileOptions)
    dense_fusion: str = "auto"  # auto | inductor | none (CompileOptions; auto is none on CPU)
    ckpt: str | None = None
    save_every: int = 0  # 0: only at the end (when --ckpt is given)
    resume: bool = False
    keep_last: int | None = 3
    router_aux_loss: bool = True  # tiny model: its load-balancing and z losses
    progress: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise OptionError(f"--precision {self.precision!r}: supported values are {PRECISIONS}")
        if self.grad_accum < 1:
            raise OptionError(f"--grad-accum {self.grad_accum}: need at least one microbatch per step")
        if self.save_every < 0:
            raise OptionError(f"--save-every {self.save_every}: must be ≥ 0")
        if (self.resume or self.save_every) and not self.ckpt:
            raise OptionError("--resume and --save-every need --ckpt DIR")
        if self.keep_last is not None and self.keep_last < 1:
            raise OptionError(f"--keep-last {self.keep_last}: must be ≥ 1")
        if self.steps < 0 or self.batch_size < 1 or self.seq_len < 2 or \
                min(self.layers, self.experts, self.top_k, self.d_model) < 1:
            raise OptionError(f"--steps {self.steps}, --batch-size {self.batch_size}, --seq-len {self.seq_len}, "
                              f"--layers {self.layers}, --experts {self.experts}, --top-k {self.top_k}, "
                              f"--d-model {self.d_model}: need steps ≥ 0, "
                              "seq-len ≥ 2 (one next-token label), the others ≥ 1")
        if not (self.lr >= 0 and math.isfinite(self.lr) and self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise OptionError(f"--lr {self.lr}, --weight-decay {self.weight_decay}: must be finite and ≥ 0")
        if self.max_grad_norm is not None and not (self.max_grad_norm >= 0):
            raise OptionError(f"--max-grad-norm {self.max_grad_norm}: must be ≥ 0 (0: no clipping)")
        # an HF family's tiny config (models/hf.py): 4 attention heads of an even width (rotary embeddings),
        # rows of its fused experts 16-byte aligned (transformers' grouped_mm), MXFP8 blocks of 32 along d
        step = 32 if self.precision == "mxfp8" else 8
        if self.model != "tiny" and self.d_model % step:
            raise OptionError(f"--d-model {self.d_model}: a transformers family's tiny model needs a multiple of {step} "
                              f"at --precision {self.precision} (4 attention heads of an even width for rotary "
                              "embeddings, expert rows of 16 bytes for grouped_mm"
                              + (", MXFP8 blocks of 32)" if step == 32 else ")"))
        if self.model == "tiny" and self.d_model % TinyMoEConfig.n_heads:
            raise OptionError(f"--d-model {self.d_model}: the tiny model's {TinyMoEConfig.n_heads} attention heads "
                              "split it evenly, so it must be a multiple of them")
        if self.capacity_factor is not None and not positive_finite(self.capacity_factor):  # before any rank starts
            raise OptionError(f"--capacity-factor {self.capacity_factor}: must be a positive number")
        if self.schedule != "1f1b" and (MeshSpec.parse(self.mesh).pp if self.mesh else 1) == 1:
            raise OptionError(schedule_without_pipeline(f"--schedule {self.schedule}"))
        if self.log_every < 1:
            raise OptionError(f"--log-every {self.log_every}: must be ≥ 1")
        if self.data:  # before any rank is spawned: a missing file is exit 2, not a failure on every rank
            check_data_file(self.data, self.seq_len)


def build_model(cfg: TrainConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    if cfg.model == "tiny":
        from ..models import TinyMoEConfig, TinyMoELM

        model = TinyMoELM(TinyMoEConfig(vocab_size=256, d_model=cfg.d_model, n_layers=cfg.layers,
                                        num_experts=cfg.experts, top_k=cfg.top_k,
                                        max_seq_len=max(256, cfg.seq_len),
                                        **({} if cfg.router_aux_loss else {"lb_coef": 0.0, "z_coef": 0.0})))
    else:
        from ..models import tiny_hf_model

        model = tiny_hf_model(cfg.model, seed=cfg.seed, layers=cfg.layers, d=cfg.d_model, experts=cfg.experts,
                              top_k=cfg.top_k, vocab=256)
    return model.to(torch.bfloat16) if cfg.precision in ("bf16", "mxfp8") else model


def compile_for(cfg: TrainConfig, model: nn.Module) -> Any:
    from .. import moe_compile

    mesh = MeshSpec.parse(cfg.mesh) if cfg.mesh else MeshSpec()
    extra = {"mxfp8": "experts"} if cfg.precision == "mxfp8" else {}
    return moe_compile(model, mesh, capacity_factor=cfg.capacity_factor, microbatches=cfg.grad_accum,
                       schedule=cfg.schedule, activation_checkpointing=cfg.activation_checkpointing,
                       dense_fusion=cfg.dense_fusion, **extra)


def train_step(cm: Any, opt: OLMoDDPOptimizer, microbatches: list[torch.Tensor]) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step over m microbatches (cm.train_step: the pipeline schedule, or accumulation
    with one reduction at pp = 1). Returns this replica's mean loss and the step result."""
    batch = torch.cat(microbatches)
    try:
        loss = cm.train_step(input_ids=batch, labels=batch, microbatches=len(microbatches))
    except BaseException:
        opt.zero_grad()  # the microbatches that did finish must not reach the next step's update
        raise
    result = opt.step()
    opt.zero_grad()
    return loss.detach().float(), result


def check_ckpt_dir(cfg: TrainConfig, rank: int) -> None:
    """Before anything is trained: --ckpt must be a writable directory, and a run without --resume
    must not write into one that holds checkpoints (its saves and --keep-last would mix with and
    prune the other run's)."""
    from .checkpoint import latest_checkpoint

    if not cfg.ckpt:
        return
    root = Path(cfg.ckpt)
    probe = root / f".write_probe_{rank}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OptionError(f"--ckpt {root}: not a writable directory ({type(e).__name__}: {e.strerror or e})") from e
    if not cfg.resume and (found := latest_checkpoint(root)) is not None:
        raise OptionError(f"--ckpt {root} already holds checkpoints (newest: {found.name}): pass --resume to "
                          "continue from it, or give an empty directory")


def _metrics_sink(path: str | None, resume_step: int):
    """Open the per-step JSONL; on resume keep the rows of steps up to the checkpoint."""
    if not path:
        return None
    p = Path(path)
    if resume_step and p.exists():
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        keep = []
        for i, ln in enumerate(lines):
            try:
                row = json.loads(ln)
            except ValueError as e:
                if i == len(lines) - 1:  # a row cut short by the crash being resumed from
                    break
                raise OptionError(f"--metrics-jsonl {p}: line {i + 1} is not JSON ({e}); only a last line "
                                  "cut short by a crash is dropped on resume") from e
            if row["step"] <= resume_step:
                keep.append(ln)
        tmp = p.with_name(p.name + ".tmp")  # a crash while trimming must not lose the rows kept
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, p)
        return open(p, "a")
    return open(p, "w")


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from tqdm import tqdm

    from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from .data import ByteFileStream, SyntheticStream, step_microbatches

    check_ckpt_dir(cfg, rank)
    cm = compile_for(cfg, build_model(cfg))
    spec = cm.program.mesh
    dp_rank = spec.dense_coords(rank)[1]
    stream = (ByteFileStream(cfg.data, cfg.seq_len, cfg.batch_size, cfg.seed) if cfg.data
              else SyntheticStream(256, cfg.seq_len, cfg.batch_size, cfg.seed))
    opt = OLMoDDPOptimizer(cm, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
    leader = rank == 0
    run_meta = {"data": cfg.data or "synthetic", "seed": cfg.seed, "model": cfg.model}
    start, position, resumed_from = 0, 0, None
    if cfg.resume:
        found = latest_checkpoint(cfg.ckpt)
        if found is not None:
            state = load_checkpoint(found, cm, opt)
            start, position, resumed_from = state.step, state.data_position, str(found)
            if leader:
                changed = {k: (state.extra.get(k), v) for k, v in run_meta.items() if state.extra.get(k) != v}
                print(f"resumed from {found} at step {start} (data position {position}) on mesh {spec}"
                      + (f"; note: changed since the checkpoint: {changed}" if changed else ""), flush=True)
        elif leader:
            print(f"--resume: no checkpoint in {cfg.ckpt} yet; starting at step 0", flush=True)
    m = cfg.grad_accum
    micro_per_step = spec.dp * m  # a CP group (and a pipeline) shares one replica's batch
    tokens_per_step = cfg.batch_size * cfg.seq_len * micro_per_step
    sink = _metrics_sink(cfg.metrics_jsonl, start) if leader else None
    bar = tqdm(total=cfg.steps, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
               disable=None if (leader and cfg.progress) else True)  # None: shown on a terminal only
    losses, times, skipped, saves = [], [], 0, []
    t_start = time.time()
    saved_at = start if resumed_from else -1
    try:
        for step in range(start, cfg.steps):
            t0 = time.time()
            local, res = train_step(cm, opt, step_microbatches(stream, position, dp_rank, m))
            position += micro_per_step
            if world > 1:
                dist.all_reduce(local)
                local /= world
            dt = time.time() - t0
            losses.append(local.item())
            times.append(dt)
            skipped += res.skipped
            rec = {"step": step + 1, "loss": losses[-1], "grad_norm": res.grad_norm, "tokens": tokens_per_step,
                   "seconds": dt, "skipped": res.skipped}
            if leader:
                if sink:
                    # a skipped step's NaN is not JSON: write null
                    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
                    sink.write(json.dumps(row, allow_nan=False) + "\n")
                    sink.flush()
                bar.set_postfix(loss=f"{losses[-1]:.4f}", grad_norm=f"{res.grad_norm:.3f}", refresh=False)
                bar.update(1)
                if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps or res.skipped:
                    note = " | skipped (non-finite gradients)" if res.skipped else ""
                    bar.write(f"step {step + 1:>4}/{cfg.steps} | loss {losses[-1]:.4f} | grad_norm {res.grad_norm:.3f} | "
                              f"{tokens_per_step / dt:,.0f} tok/s{note}", file=sys.stdout)
                    sys.stdout.flush()
            # After the step's metrics row: a checkpoint never claims a step whose row is missing.
            if cfg.ckpt and cfg.save_every and (step + 1) % cfg.save_every == 0:
                ts = time.time()
                save_checkpoint(cfg.ckpt, cm, opt, step + 1, position, run_meta, cfg.keep_last)
                saves.append(time.time() - ts)
                saved_at = step + 1
        if cfg.ckpt and saved_at != cfg.steps and cfg.steps > start:
            save_checkpoint(cfg.ckpt, cm, opt, cfg.steps, position, run_meta, cfg.keep_last)
    finally:
        bar.close()
        if sink:
            sink.close()
    total = time.time() - t_start
    steady = times[1:] or times
    return {
        "model": cfg.model,
        "mesh": str(spec),
        "ranks": world,
        "steps": cfg.steps,
        "start_step": start,
        "resumed_from": resumed_from,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "skipped_steps": skipped,
        "seconds": total,
        "compile_and_first_step_seconds": times[0] if times else None,
        "step_seconds": sum(steady) / len(steady) if steady else None,
        "tokens_per_second": tokens_per_step * len(steady) / sum(steady) if steady else None,
        "save_seconds": sum(saves) / len(saves) if saves else None,
        "program": _program_facts(cm),
        "config": asdict(cfg),
    }


def _program_facts(cm: Any) -> dict[str, Any]:
    """How the compiled program runs what the config asked for: recompute and dense fusion (from the
    lowered graphs of this rank's program; a pipeline stage's, on its own rank)."""
    from ..ledger.memory import recomputed_ops

    # at pp > 1 the rank's stage programs hold the graphs (the whole program captured none)
    progs = cm.pipeline._stage_programs() if cm.pipeline is not None else [cm.program]
    sets = [p.training_graphs for p in progs]
    fusion = sorted({g.meta["moe_dense_fusion"]["mode"] for gs in sets for g in gs.values() if "moe_dense_fusion" in g.meta})
    pairs = [(gs["forward"], gs["backward"]) for gs in sets if "forward" in gs and "backward" in gs]
    return {"activation_checkpointing": cm.program.options.activation_checkpointing,
            "recomputed_ops": sum(recomputed_ops(f, b) for f, b in pairs) if pairs else None,
            "dense_fusion": fusion}


def print_summary(s: dict[str, Any], out=sys.stdout) -> None:
    if s["first_loss"] is None:
        print(f"done: {s['model']} on mesh {s['mesh']}: already at step {s['start_step']} of {s['steps']}, "
              "nothing to train", file=out, flush=True)
        return
    resumed = f" (resumed at step {s['start_step']})" if s["resumed_from"] else ""
    print(
        f"done: {s['model']} on mesh {s['mesh']} ({s['ranks']} ranks), {s['steps']} steps{resumed} in "
        f"{s['seconds']:.1f}s | loss {s['first_loss']:.4f} → {s['final_loss']:.4f} | "
        f"step {s['step_seconds'] * 1000:.0f} ms | {s['tokens_per_second']:,.0f} tok/s "
        f"(first step incl. compile: {s['compile_and_first_step_seconds']:.1f}s)"
        + (f" | {s['skipped_steps']} step(s) skipped" if s["skipped_steps"] else "")
        + _program_note(s.get("program") or {}),
        file=out, flush=True,
    )


def _program_note(p: dict[str, Any]) -> str:
    """The summary's note on recompute and dense fusion, when either is on."""
    note = ""
    if p.get("activation_checkpointing"):
        note += f" | recompute {p['activation_checkpointing']} ({p['recomputed_ops']} ops)"
    if "inductor" in p.get("dense_fusion", ()):
        note += " | dense fusion inductor"
    return note
