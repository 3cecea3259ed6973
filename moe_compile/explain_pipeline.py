"""Per-stage figures of a pipelined program, for ``moe-compile explain`` (mesh with pp > 1).

Glossary: P / PP, P_local, persistent training state, lease, high-water, B / m. Every stage is
compiled on the explaining rank (PipelineRuntime.plan_stages), so each row is measured on its own
graphs and lease plan:

    P_local           parameters a rank of stage s holds (its layers; embeddings on the first stage,
                      final norm and head on the last; routed experts as this rank's ep_mp shard)
    persistent bytes  weights + FP32 main_grad + optimizer state (FP32 main, exp_avg, exp_avg_sq:
                      12 B per element, ZeRO-1 over the family's replicas: dense dp·cp, experts ep_dp)
                      + the reduced part of a reduce-scattered bucket of a family with replicas
                      (4/n B per element; the ledger's M_grad_shards)
    saved / mb        activations one microbatch's forward keeps for its backward (graph_memory)
    H_s               forwards in flight of stage s under the schedule's action order
    activation HW     (H_s − 1) · saved + the stage graphs' own high-water (one graph running while
                      H_s − 1 microbatches wait for their backward)
    lease bytes       symmetric bytes of the stage's lease pools with H_s instances; "per microbatch"
                      is the same plan with one instance per microbatch in the step (H = m), what a
                      schedule-blind allocator needs
    bubble            idle share of a rank's step with equal-cost stages, (pp − 1)/(v·m + pp − 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .leases import LEASE_FAMILY


def _bytes_per_element(name: str, cm) -> float:
    spec = cm.program.mesh
    replicas = spec.ep_dp if cm.is_expert_param(name) else spec.dp * spec.cp
    shards = 4 / replicas if replicas > 1 else 0  # the reduce-scatter's reduced part
    return 4 + 12 / replicas + shards  # main_grad + ZeRO-1 share of the optimizer state + reduced part


def stage_rows(cm, programs: dict[int, Any]) -> dict[str, Any]:
    from .ledger.memory import graph_memory

    pipe = cm.pipeline
    split, sched = pipe.split, pipe.schedule
    params = dict(cm.model.named_parameters())
    rows = []
    for s, prog in sorted(programs.items()):
        mine = [n for n, st in split.owner.items() if st == s and n in params]
        p_local = sum(params[n].numel() for n in mine)
        weights = sum(params[n].numel() * params[n].element_size() for n in mine)
        state = sum(params[n].numel() * _bytes_per_element(n, cm) for n in mine if params[n].requires_grad)
        gm = None
        if "forward" in prog.training_graphs:
            gm = graph_memory(prog.training_graphs["forward"], prog.training_graphs.get("backward"),
                              symmetric=prog.transport == "symmetric")
        h = sched.in_flight.get(s, 1)
        plan = prog.lease_plans.get("training")
        lease = plan.symmetric_bytes if plan is not None else 0
        blind = 0
        if plan is not None:
            blind = dataclasses.replace(plan, in_flight={s: sched.microbatches}).symmetric_bytes
        rows.append({
            "stage": s, "layers": split.layers_of(s), "P_local": p_local, "persistent_bytes": int(weights + state),
            "saved_bytes_per_microbatch": gm.saved_bytes if gm else None, "H_s": h,
            "activation_high_water": (h - 1) * gm.saved_bytes + gm.high_water if gm else None,
            "lease_bytes": lease, "lease_bytes_one_per_microbatch": blind,
            "lease_high_water": {f: v * h if f == LEASE_FAMILY else v
                                 for (st, f), v in (plan.high_water.items() if plan else ()) if st == s},
        })
    return {"schedule": sched.name, "microbatches": sched.microbatches, "stages_per_rank": sched.stages_per_rank,
            "bubble_fraction": sched.bubble_fraction(), "cost_balanced": list(split.cost), "stages": rows}


def stage_table_html(data: dict[str, Any]) -> str:
    import html

    head = ("<p>" + html.escape(f"schedule {data['schedule']}, m={data['microbatches']}, "
                                f"{data['stages_per_rank']} stage(s) per rank; pipeline bubble "
                                f"{data['bubble_fraction']:.3f} of a step") + "</p>")
    cols = ["stage", "layers", "P_local", "persistent_bytes", "saved_bytes_per_microbatch", "H_s",
            "activation_high_water", "lease_bytes", "lease_bytes_one_per_microbatch"]
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in cols) + "</tr>"
                   for r in data["stages"])
    return head + "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + rows + "</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list):
        return f"{v[0]}–{v[-1]}" if len(v) > 1 else str(v[0]) if v else ""
    return "" if v is None else str(v)
