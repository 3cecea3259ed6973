"""``moe-compile`` command line: ``train`` (compiled training on local CPU ranks or under torchrun)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import fields

from .errors import MoECompileError, OptionError
from .mesh import MeshSpec
from .train.loop import TrainConfig, check_ckpt_dir, print_summary, train_rank


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small MoE model expert-parallel",
                       description="Train the tiny reference MoE LM (or a tiny random HF config) with moe_compile. "
                                   "Spawns --ranks local CPU ranks (gloo) unless run under torchrun.")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mesh", default="", help='mesh degrees, e.g. "ep_mp=2" or "dp=4,ep_mp=2" (default: all dp)')
    p.add_argument("--ranks", type=int, default=1, help="local CPU ranks to spawn (ignored under torchrun)")
    p.add_argument("--hf", choices=["olmoe", "mixtral", "qwen2_moe"], help="tiny random config of an HF family")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity-factor", type=float, default=None, help="rank-level capacity (default: dropless)")
    p.add_argument("--data", default=None, help="local text file, byte-level tokens (default: synthetic)")
    p.add_argument("--metrics-jsonl", default=None, help="write one JSON object per step here")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "mxfp8"], default="fp32",
                   help="fp32; bf16 (model in BF16, FP32 main weights in the optimizer); mxfp8 (routed experts)")
    p.add_argument("--microbatches", "--grad-accum", dest="grad_accum", type=int, default=1, metavar="M",
                   help="microbatches per optimizer step (the pipeline schedule's m; at pp=1 accumulation)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default="1f1b",
                   help="pipeline schedule for a mesh with pp>1 (torch.distributed.pipelining)")
    _compile_option_arguments(p)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--ckpt", default=None, metavar="DIR", help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps (and at the end when --ckpt is given)")
    p.add_argument("--keep-last", type=int, default=3, help="complete checkpoints to keep in --ckpt")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt, under the --mesh and --ranks given now")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--no-router-aux-loss", dest="router_aux_loss", action="store_false",
                   help="tiny model: no load-balancing / z loss (the HF families train without theirs)")


def _compile_option_arguments(p: argparse.ArgumentParser) -> None:
    """The compile options `train` and `families` both take."""
    p.add_argument("--activation-checkpointing", choices=["none", "selective", "moe", "full"], default="none",
                   help="recompute in backward: selective (elementwise ops), moe (the MoE blocks), full (default: "
                   "none); the routing is saved in every mode")
    p.add_argument("--dense-fusion", choices=["auto", "inductor", "none"], default="auto",
                   help="compile the dense part of the graphs with inductor (auto: none on CPU, where the compile "
                   "pays back after some hundred steps; see README)")


def _ac_mode(value: str) -> str | None:
    return None if value == "none" else value


def _config(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["model"] = args.hf or "tiny"
    if not kw.get("max_grad_norm"):
        kw["max_grad_norm"] = None
    kw["activation_checkpointing"] = _ac_mode(args.activation_checkpointing)
    return TrainConfig(**kw)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Failure|Interrupt|Exit)\b[^:\s]*: ")


def failure_cause(traceback_text: str) -> str:
    """The line of a rank's traceback that says what went wrong: the last ``SomeError: message`` line
    (torch.compile ends its tracebacks with a TORCHDYNAMO_VERBOSE hint, and chained errors end with
    the outermost wrapper), else the last non-empty line."""
    lines = [ln.rstrip() for ln in traceback_text.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if _EXC_LINE.match(ln)), lines[-1] if lines else traceback_text)


def cmd_train(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        if "RANK" not in os.environ:  # torchrun ranks check in train_rank
            check_ckpt_dir(cfg, 0)  # before spawning anything: a clear exit 2
    except OptionError as e:
        print(f"moe-compile train: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            summary = train_rank(dist.get_rank(), dist.get_world_size(), cfg)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if summary and int(os.environ["RANK"]) == 0:
            print_summary(summary)
        return 0
    if args.ranks < 1:
        print(f"--ranks {args.ranks}: need at least one rank", file=sys.stderr)
        return 2
    try:  # before any rank starts: every rank would print the same MeshError's traceback
        (MeshSpec.parse(cfg.mesh) if cfg.mesh else MeshSpec()).resolve(args.ranks)
    except MoECompileError as e:
        print(f"moe-compile train: {e}", file=sys.stderr)
        return 2
    from .runtime.launcher import RankFailure, spawn_ranks

    try:
        summary = spawn_ranks(train_rank, args.ranks, cfg, timeout=24 * 3600)[0]
    except RankFailure as e:
        print(str(e), file=sys.stderr)
        text = e.failures[0][1] if e.failures else str(e)
        print(f"moe-compile train failed: {failure_cause(text)}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


def _explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="plan a run: cost ledger, graphs and report, without ranks",
                       description="Compile a model for a mesh in one process (fake process group, meta tensors: "
                                   "full-size published configs need no weights) and write ledger.json, the graphs "
                                   "and report.html to --out. Pictures (SVG, PNG) need graphviz's `dot` program; "
                                   "without it the graph sources (.dot) are written instead.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="published config: olmoe-1b-7b, mixtral-8x7b, qwen1.5-moe-a2.7b, deepseek-v3")
    src.add_argument("--hf-config", help="a transformers config.json (with model_type)")
    src.add_argument("--model", choices=["tiny"], help="the tiny reference model")
    p.add_argument("--mesh", required=True, help='mesh degrees, e.g. "dp=64,ep_mp=8" (dp or ep_dp fixes the world)')
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--rank", type=int, default=0, help="the rank whose program is shown (default 0)")
    p.add_argument("--world", type=int, default=None, help="world size (default: from the mesh)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: min(4096, model limit))")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per micro-batch")
    p.add_argument("--micro-batches", "--microbatches", dest="micro_batches", type=int, default=1,
                   help="micro-batches per optimizer step (m; the pipeline schedule's, with pp>1)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default="1f1b",
                   help="pipeline schedule for a mesh with pp>1")
    p.add_argument("--capacity-factor", type=float, default=None, help="rank-level capacity (default: dropless)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (bfloat16, float32, float16)")
    p.add_argument("--no-png", action="store_true", help="write SVG graphs only")


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain

    try:
        res = explain(mesh=args.mesh, out_dir=args.out, hf=args.hf, hf_config=args.hf_config, model=args.model,
                      rank=args.rank, world=args.world, seq_len=args.seq_len, batch_size=args.batch_size,
                      micro_batches=args.micro_batches, capacity_factor=args.capacity_factor, dtype=args.dtype,
                      png=not args.no_png, schedule=args.schedule)
    except MoECompileError as e:
        print(f"moe-compile explain: {e}", file=sys.stderr)
        return 2
    led = res.ledger
    print(f"{res.name} on mesh {res.mesh}: {led.shorthand} (P_active@P_total), P_local {led['P_local']:,} per rank")
    for group, name, value, _form, doc in led.rows():
        print(f"  {group:<10} {name:<20} {value:>16}  {doc[:70]}")
    for n in led.notes:
        print(f"  note: {n}")
    if res.context_parallel is not None:
        c = res.context_parallel
        print(f"  context parallel: cp={c['cp']}, K/V all-gathered {c['kv_gathered_bytes'] / 2**20:.1f} MiB per step, "
              f"CP traffic {c['cp_bytes_per_step'] / 2**20:.1f} MiB per rank, attention "
              f"{c['attn_flops_per_step'] / 1e12:.3f} TFLOP per rank")
        for r in c["scaling"]:
            print(f"    cp={r['cp']}: saved activations {(r['saved_bytes'] or 0) / 2**30:.2f} GiB, attention "
                  f"{r['attn_flops'] / 1e12:.3f} TFLOP, CP bytes {r['cp_bytes'] / 2**20:.1f} MiB")
    if res.pipeline is not None:
        pl = res.pipeline
        print(f"  pipeline: {pl['schedule']}, m={pl['microbatches']}, bubble {pl['bubble_fraction']:.3f} of a step")
        for r in pl["stages"]:
            hw = r["activation_high_water"]
            print(f"    stage {r['stage']}: layers {r['layers'][0]}–{r['layers'][-1]}, P_local {r['P_local']:,}, "
                  f"persistent {r['persistent_bytes'] / 2**30:.2f} GiB, H_s {r['H_s']}, activation high-water "
                  f"{(hw or 0) / 2**30:.2f} GiB, lease {r['lease_bytes'] / 2**20:.1f} MiB "
                  f"(one per microbatch: {r['lease_bytes_one_per_microbatch'] / 2**20:.1f} MiB)")
    for key, path in res.files.items():
        print(f"  wrote {key}: {path}")
    for m in res.messages:
        print(f"moe-compile explain: {m}", file=sys.stderr)
    return 0


def _families_parser(sub) -> None:
    p = sub.add_parser("families", help="which MoE families of the installed transformers compile",
                       description="For every MoE causal-LM family the installed transformers registers: build a tiny "
                                   "random config (2 layers, 8 experts, top-2), compile it and compare loss and every "
                                   "gradient with the dense model (fp32, 1e-5), or print the error. Runs the families "
                                   "in --ranks spawned CPU ranks on --mesh.")
    p.add_argument("names", nargs="*", help="model types to check (default: every MoE family)")
    p.add_argument("--mesh", default="ep_mp=1", help='mesh degrees, e.g. "ep_mp=2" (default: one rank)')
    p.add_argument("--ranks", type=int, default=1, help="local CPU ranks to spawn")
    p.add_argument("--list", action="store_true", help="only list the families, compile nothing")
    p.add_argument("--router-logits", action="store_true",
                   help="with output_router_logits=True where the config has it: the load-balancing aux_loss compared too")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches of each step at pp > 1 (default: pp); the step is cm.train_step")
    _compile_option_arguments(p)  # the dense reference stays eager


def cmd_families(args: argparse.Namespace) -> int:
    from .families import format_table, moe_families, sweep_worker
    from .runtime.launcher import RankFailure, spawn_ranks

    names = args.names or moe_families()
    unknown = sorted(set(names) - set(moe_families()))
    if unknown:
        print(f"moe-compile families: not MoE causal-LM families of this transformers: {unknown}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(names))
        return 0
    try:  # before any rank starts: a bad mesh would otherwise be an "error" row for every family, exit 0
        if args.ranks < 1:
            raise OptionError(f"--ranks {args.ranks}: must be ≥ 1")
        MeshSpec.parse(args.mesh).resolve(args.ranks)
    except MoECompileError as e:
        print(f"moe-compile families: {e}", file=sys.stderr)
        return 2
    try:
        options = {"activation_checkpointing": _ac_mode(args.activation_checkpointing),
                   "dense_fusion": args.dense_fusion}
        results = spawn_ranks(sweep_worker, args.ranks, names, args.mesh, args.router_logits, args.microbatches,
                              options, timeout=24 * 3600)[0]
    except RankFailure as e:
        print(f"moe-compile families failed: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    return 1 if any(r.status in ("wrong", "crash") for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-compile", description="Compile MoE models for expert-parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _explain_parser(sub)
    _families_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        return cmd_train(args)
    if args.command == "explain":
        return cmd_explain(args)
    if args.command == "families":
        return cmd_families(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
