"""CPU benchmark, one run, ratios on the same machine:

1. MoE-layer forward+backward: moe_compile's single-rank compiled path vs transformers' own CPU
   implementations of the same block (its per-expert eager loop and its grouped_mm path).
2. Training-step time of the demo (`moe-compile train`) on 1, 2 and 4 local ranks (ep_mp = ranks).

    python benchmarks/cpu_moe.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def time_fwd_bwd(fns: dict, x, gy, iters: int, warmup: int = 3) -> dict[str, float]:
    """Median forward+backward seconds per path, the paths interleaved round-robin so that machine
    drift (other load, frequency) hits them alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            xx = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            fn(xx).backward(gy)
            if i >= warmup:
                samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def layer_benchmark(tokens: int, d: int, h: int, experts: int, top_k: int, iters: int) -> dict:
    import transformers as tf

    from moe_compile import moe_compile

    cfg = tf.OlmoeConfig(hidden_size=d, intermediate_size=h, num_experts=experts, num_experts_per_tok=top_k,
                         num_hidden_layers=1, num_attention_heads=4, vocab_size=256, eos_token_id=None)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = tf.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock(cfg).float()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, d)
    gy = torch.randn(1, tokens, d)
    eager = copy.deepcopy(block)
    eager.experts.config._experts_implementation = "eager"
    grouped = copy.deepcopy(block)
    grouped.experts.config._experts_implementation = "grouped_mm"
    compiled = moe_compile(copy.deepcopy(block))
    y_ref, y = grouped(x), compiled(x.detach().requires_grad_(True))
    err = ((y - y_ref).abs().max() / y_ref.abs().max()).item()
    t = time_fwd_bwd({"hf_eager_loop": eager, "hf_grouped_mm": grouped, "moe_compile": compiled}, x, gy, iters)
    compiled.close()
    return {
        "shape": {"tokens": tokens, "d_model": d, "h_e": h, "num_experts": experts, "top_k": top_k},
        "seconds": t,
        "ratio_vs_eager_loop": t["moe_compile"] / t["hf_eager_loop"],
        "ratio_vs_grouped_mm": t["moe_compile"] / t["hf_grouped_mm"],
        "max_rel_diff_vs_hf": err,
    }


def step_benchmark(ranks: list[int], steps: int) -> list[dict]:
    from moe_compile.runtime.launcher import spawn_ranks
    from moe_compile.train.loop import TrainConfig, train_rank

    out = []
    for n in ranks:
        cfg = TrainConfig(steps=steps, mesh=f"ep_mp={n}", batch_size=4, seq_len=64, log_every=10**9)
        s = spawn_ranks(train_rank, n, cfg, env={"OMP_NUM_THREADS": "1"})[0]
        out.append({"ranks": n, "mesh": s["mesh"], "step_seconds": s["step_seconds"],
                    "tokens_per_second": s["tokens_per_second"], "final_loss": s["final_loss"]})
    base = out[0]["step_seconds"]
    for r in out:
        r["step_time_vs_1_rank"] = r["step_seconds"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    iters = 5 if args.quick else 60
    layers = [layer_benchmark(1024, 256, 256, 16, 4, iters), layer_benchmark(4096, 512, 256, 64, 8, max(3, iters // 6))]
    steps = step_benchmark([1, 2, 4], 10 if args.quick else 30)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\nMoE layer forward+backward (OLMoE block, fp32, one rank)")
    print(f"{'shape (T, d, h_e, N, K)':<28}{'HF eager loop':>14}{'HF grouped_mm':>15}{'moe_compile':>13}"
          f"{'vs eager':>10}{'vs grouped':>12}")
    for r in layers:
        s, t = r["shape"], r["seconds"]
        shape = f"({s['tokens']}, {s['d_model']}, {s['h_e']}, {s['num_experts']}, {s['top_k']})"
        print(f"{shape:<28}{t['hf_eager_loop'] * 1e3:>11.1f} ms{t['hf_grouped_mm'] * 1e3:>12.1f} ms"
              f"{t['moe_compile'] * 1e3:>10.1f} ms{r['ratio_vs_eager_loop']:>10.2f}{r['ratio_vs_grouped_mm']:>12.2f}")
    print("\nDemo training step (tiny MoE LM, 4×64 tokens per rank, ep_mp = ranks, gloo on CPU)")
    print(f"{'ranks':<8}{'step':>10}{'tokens/s':>12}{'step vs 1 rank':>16}")
    for r in steps:
        print(f"{r['ranks']:<8}{r['step_seconds'] * 1e3:>7.0f} ms{r['tokens_per_second']:>12,.0f}"
              f"{r['step_time_vs_1_rank']:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": layers, "steps": steps}, f, indent=2)


if __name__ == "__main__":
    main()
