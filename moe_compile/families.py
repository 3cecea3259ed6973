"""Every MoE causal-LM family of the installed transformers, and whether moe_compile compiles it.

The families come from transformers' own registries: every model type of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class declares a routed-expert field
(:data:`~moe_compile.models.hf.MOE_FIELDS`). Multimodal wrappers (whose experts live in a
``text_config``) are covered by their ``*_text`` model type, which the registry lists on its own.

For each family :func:`check_family` builds a tiny random config (:func:`tiny_family_config`: 2 layers,
d=64, 8 experts, top-2, vocab 256), runs the dense model and the compiled one on the same batches and
compares the loss and every gradient (fp32); with ``output_router_logits=True`` among the config overrides,
the load-balancing ``aux_loss`` too (the sweep's ``router_logits``). The outcome is one of:

* ``compiled``: parity within ``tol`` (max relative error of each tensor against its own scale), or,
  for a gradient the fp32 dense model itself does not get to ``tol`` (an ill-conditioned one, e.g. the
  gated-delta-rule decay ``A_log``: a sum that cancels to 1e-5 of its terms), within ``tol`` of the fp64
  dense gradient or within 3× fp32's own error against it: the largest of the fp32 dense model's and
  of a few fp32 dense runs whose MoE blocks' outputs and gradients carry a rounding-level jitter
  (:func:`_fp64_parity`), and with ``dense_fusion="inductor"`` of torch.compile(dense model);
* ``error``: moe_compile refused it with a :class:`MoECompileError` (the message says why);
* ``wrong``: it compiled but the loss or a gradient differs;
* ``crash``: any other exception (from moe_compile, or the tiny config could not be built/run densely:
  the message says which stage).

``moe-compile families`` prints the table; ``tests/test_families.py`` fails on ``wrong`` and ``crash``.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import MoECompileError

TOL = 1e-5
STATUSES = ("compiled", "error", "wrong", "crash")


@dataclass(frozen=True)
class FamilyResult:
    family: str  # the transformers model type
    status: str  # compiled | error | wrong | crash
    message: str  # the error, or "loss … grad …" errors for compiled/wrong
    loss_err: float | None = None
    grad_err: float | None = None
    worst: str | None = None  # the parameter with the largest gradient error
    seconds: float = 0.0
    module_paths: tuple[str, ...] = ()  # the dense model's module names (to check errors name one)

    def summary(self) -> str:
        first = self.message.splitlines()[0] if self.message else ""
        return f"{self.family:<22} {self.status:<9} {first}"


def moe_families() -> list[str]:
    """Model types of every MoE causal LM the installed transformers registers, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .models.hf import MOE_FIELDS, _fields

    return sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                  if mt in CONFIG_MAPPING and set(MOE_FIELDS) & _fields(CONFIG_MAPPING[mt]))


def _batches(world: int, vocab: int, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1007)
    return [torch.randint(3, vocab, (batch, seq), generator=g) for _ in range(world)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def check_family(family: str, mesh: str = "ep_mp=1", rank: int = 0, world: int = 1, tol: float = TOL,
                 microbatches: int | None = None, options: dict | None = None, **config_overrides) -> FamilyResult:
    """Compile one family's tiny random model on ``mesh`` and compare it with the dense model.

    Call on every rank of an initialised world (or in one process for a one-rank mesh); every rank
    returns its own result (each compares its own loss and the reduced gradients). Each data-parallel
    replica runs its own batch; the ranks of one CP group and of one pipeline pass the same one (they
    shard it). At pp > 1 the step is ``cm.train_step`` over ``microbatches`` (default pp) microbatches,
    and the dense reference the mean of the microbatches' losses (equal token counts: the batch mean,
    aux losses per microbatch as the schedule computes them). ``options``: further moe_compile options
    (activation_checkpointing, dense_fusion), the same dense reference."""
    from . import MeshSpec, moe_compile
    from .codegen.dense_fusion import resolve_dense_fusion
    from .models.hf import tiny_family_model

    t0 = time.perf_counter()

    def result(status, message, **kw):
        return FamilyResult(family, status, message, seconds=time.perf_counter() - t0, **kw)

    try:
        spec = MeshSpec.parse(mesh).resolve(world)
        m = (microbatches or spec.pp) if spec.pp > 1 else 1
        replica = spec.dense_coords(rank)[1]  # this rank's data-parallel replica: its batch
        model = tiny_family_model(family, **config_overrides)
        paths = tuple(n for n, _ in model.named_modules() if n)
        batches = _batches(spec.dp, model.config.get_text_config().vocab_size, batch=max(2, m))
        ref, pristine = copy.deepcopy(model), copy.deepcopy(model)
        ref_outs = [[ref(input_ids=x, labels=x) for x in b.chunk(m)] for b in batches]
        ref_losses = [sum(o.loss for o in outs) / m for outs in ref_outs]
        torch.stack(ref_losses).mean().backward()
        ref_grads = _grads(ref)
        del ref
    except Exception as e:  # noqa: BLE001 - reported as the family's outcome
        return result("crash", f"tiny config / dense model: {_first_line(e)}")
    cm = None
    b = batches[replica]
    try:
        cm = moe_compile(model, spec, **({"microbatches": m} if spec.pp > 1 else {}), **(options or {}))
        blocks = list(cm.program.blocks)  # the module paths moe_compile rewrote
        if spec.pp > 1:  # cm(...) is forward-only evaluation on a pipeline: train_step runs the schedule
            out = None
            loss = cm.train_step(input_ids=b, labels=b)
        else:
            out = cm(input_ids=b, labels=b)
            out.loss.backward()
            loss = out.loss
        grads = cm.full_grads()
    except MoECompileError as e:
        return result("error", f"{type(e).__name__}: {e}", module_paths=paths)
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {tb[-1].filename.rsplit('/', 2)[-2:]}:{tb[-1].lineno})" if tb else ""
        return result("crash", f"{_first_line(e)}{where}", module_paths=paths)
    finally:
        if cm is not None:
            cm.close()
    ref_loss = ref_losses[replica].item()
    loss_err = abs(loss.item() - ref_loss) / max(1.0, abs(ref_loss))
    ref_aux = getattr(ref_outs[replica][0], "aux_loss", None) if m == 1 else None  # train_step returns the loss only
    if isinstance(ref_aux, torch.Tensor):  # output_router_logits: the load-balancing loss on its own
        aux = getattr(out, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            return result("wrong", f"the dense model returns aux_loss {ref_aux.item():.4g}, the compiled one {aux!r}")
        loss_err = max(loss_err, abs(aux.item() - ref_aux.item()) / max(1.0, abs(ref_aux.item())))
    if set(grads) != set(ref_grads):
        return result("wrong", f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:4]}")
    worst = max(grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    grad_err = _rel(grads[worst], ref_grads[worst])
    ok = loss_err <= tol and grad_err <= tol
    msg = f"loss err {loss_err:.1e}, grad err {grad_err:.1e} ({worst})"
    if loss_err <= tol and not ok:
        fused = resolve_dense_fusion((options or {}).get("dense_fusion", "auto"), "cpu") == "inductor"
        ok, note = _fp64_parity(pristine, [x for b in batches for x in b.chunk(m)], grads, ref_grads, tol, blocks,
                                inductor=fused, cp=spec.cp)
        msg += f"; {note}"
    return result("compiled" if ok else "wrong", msg, loss_err=loss_err, grad_err=grad_err, worst=worst,
                  module_paths=paths)


class _Jitter(torch.autograd.Function):
    """x·(1 + 2⁻²⁴·r) forward and the gradient likewise backward (r ~ N(0, 1), seeded): a change of the
    size of one fp32 rounding, as a different order of the same arithmetic makes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seed: int) -> torch.Tensor:
        ctx.seed = seed
        r = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return x * (1 + 2.0**-24 * r).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        r = torch.randn(g.shape, generator=torch.Generator().manual_seed(ctx.seed + 1), dtype=torch.float64)
        return g * (1 + 2.0**-24 * r).to(g.dtype), None


def _jittered_grads(model: nn.Module, batches, blocks: list[str], seed: int) -> dict[str, torch.Tensor]:
    """The fp32 dense model's gradients with every MoE block's output (and its gradient) jittered."""
    model = copy.deepcopy(model)

    def hook(mod, inputs, out):
        if isinstance(out, tuple):
            return (_Jitter.apply(out[0], seed),) + tuple(out[1:])
        return _Jitter.apply(out, seed) if isinstance(out, torch.Tensor) else out

    for path in blocks:
        model.get_submodule(path).register_forward_hook(hook)
    torch.stack([model(input_ids=b, labels=b).loss for b in batches]).mean().backward()
    return _grads(model)


JITTER_RUNS = 4


def _inductor_grads(model: nn.Module, batches) -> list[dict[str, torch.Tensor]]:
    """The fp32 dense model's gradients under torch.compile (inductor), or none where it cannot run."""
    model = copy.deepcopy(model)
    try:
        run = torch.compile(model)
        torch.stack([run(input_ids=b, labels=b).loss for b in batches]).mean().backward()
    except Exception:  # noqa: BLE001 - no such reference: the others decide
        return []
    return [_grads(model)]


def _cp_split_grads(model: nn.Module, batches, cp: int) -> list[dict[str, torch.Tensor]]:
    """The fp32 dense model's gradients summed over cp backward passes, each of one CP rank's tokens' losses
    (over the whole batch's token count; the load-balancing loss once): the order of sums a CP group makes,
    which moves an ill-conditioned gradient (the gated-delta-rule decay's) by 10× more than one pass does."""
    from .runtime.context_parallel import shard_positions

    model = copy.deepcopy(model)
    try:
        for b in batches:
            shift = torch.cat([b[:, 1:], torch.full_like(b[:, :1], -100)], 1)
            for r in range(cp):
                keep = torch.zeros(b.shape[1], dtype=torch.bool)
                keep[shard_positions(b.shape[1], cp, r)] = True
                labels = shift.masked_fill(~keep, -100)
                aux = {} if r == 0 else {"output_router_logits": False}
                out = model(input_ids=b, labels=labels, shift_labels=labels, num_items_in_batch=(shift != -100).sum(),
                            **aux)
                (out.loss / len(batches)).backward()
    except Exception:  # noqa: BLE001 - no such reference: the others decide
        return []
    return [_grads(model)]


def _fp64_parity(model: nn.Module, batches, grads: dict, ref_grads: dict, tol: float,
                 blocks: list[str] = (), inductor: bool = False, cp: int = 1) -> tuple[bool, str]:
    """Parity where fp32 itself is too coarse: every gradient that differs from the fp32 dense one by more
    than ``tol`` must be within ``tol`` of an fp64 run of the dense model, or within 3× fp32's own error
    against it. fp32's own error is the largest of the fp32 dense model's and of JITTER_RUNS fp32 dense
    runs with a rounding-level jitter on the MoE blocks moe_compile rewrote (``blocks``): its kernels
    compute those blocks in another order, and an ill-conditioned gradient (a sum that cancels to 1e-5
    of its terms, as the gated-delta-rule decay's) moves by up to 10× more under such a change than the
    one fp32 dense run's error shows (Qwen3.5-MoE's dt_bias: 4.3e-6 unjittered, up to 3.7e-5 jittered).
    ``cp`` > 1: one more fp32 run sums the dense model's backward over the CP shards' tokens, as the CP group
    sums its ranks' (:func:`_cp_split_grads`; Qwen3-Next's A_log: 1.6e-5 off fp64 in one pass, 1.8e-4 split).
    ``inductor``: the dense part was compiled with inductor, which reorders it as well, so torch.compile of
    the dense model is one more fp32 run (Qwen3.5-MoE's dt_bias: 1.1e-4 off fp64 there, 3e-5 in eager)."""
    fp32_model = copy.deepcopy(model)  # model itself becomes the fp64 one
    try:
        model = model.double()
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
        torch.stack([model(input_ids=b, labels=b).loss for b in batches]).mean().backward()
        exact = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    except Exception as e:  # noqa: BLE001 - no fp64 reference: the fp32 verdict stands
        return False, f"no fp64 reference ({_first_line(e)})"
    runs = [_jittered_grads(fp32_model, batches, list(blocks), seed) for seed in range(JITTER_RUNS)] if blocks else []
    if inductor:
        runs += _inductor_grads(fp32_model, batches)
    if cp > 1:
        runs += _cp_split_grads(fp32_model, batches, cp)
    worst = (0.0, 0.0, "")
    for n in grads:
        if _rel(grads[n], ref_grads[n]) <= tol or n not in exact:
            continue
        own = _rel(grads[n].double(), exact[n])
        fp32 = max(_rel(g[n].double(), exact[n]) for g in [ref_grads, *runs])
        if own > max(tol, 3 * fp32):
            return False, f"{n}: off by {own:.1e} from fp64, fp32's own error {fp32:.1e}"
        worst = max(worst, (own, fp32, n))
    return True, (f"within fp32's own error ({worst[2]}: off by {worst[0]:.1e} from fp64, fp32's own error "
                  f"{worst[1]:.1e})")


def sweep(families: list[str] | None = None, mesh: str = "ep_mp=1", rank: int = 0, world: int = 1,
          progress=None, router_logits: bool = False, microbatches: int | None = None,
          options: dict | None = None) -> list[FamilyResult]:
    """:func:`check_family` for every family (default: all of :func:`moe_families`), in order.
    ``router_logits``: with ``output_router_logits=True`` on the families whose config has the flag."""
    from .models.hf import tiny_family_config

    out = []
    for f in families if families is not None else moe_families():
        overrides = {}
        if router_logits:
            try:
                cfg = tiny_family_config(f)
            except Exception:  # noqa: BLE001 - check_family reports the config it cannot build
                cfg = None
            if cfg is not None and hasattr(cfg, "output_router_logits"):
                overrides["output_router_logits"] = True
        out.append(check_family(f, mesh, rank, world, microbatches=microbatches, options=options, **overrides))
        if progress is not None:
            progress(out[-1])
    return out


def sweep_worker(rank: int, world: int, families: list[str] | None, mesh: str,
                 router_logits: bool = False, microbatches: int | None = None,
                 options: dict | None = None) -> list[FamilyResult]:
    """For :func:`moe_compile.runtime.launcher.spawn_ranks`: one rank of a sweep."""
    import transformers

    transformers.logging.set_verbosity_error()
    return sweep(families, mesh, rank, world, router_logits=router_logits, microbatches=microbatches, options=options)


def format_table(results: list[FamilyResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines = [f"{'family':<22} {'status':<9} detail"] + [r.summary() for r in results]
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(results)} families")
    return "\n".join(lines)
