"""Checkpoints: kill -9 and resume (bitwise), crash mid-save, mismatched, truncated and bit-flipped
checkpoints, frozen parameters across meshes; BF16 compute weights with FP32 main weights, and skipped
non-finite steps."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import CheckpointError
from moe_compile.train.checkpoint import (
    MANIFEST,
    _manifest_sha256,
    file_sha256,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from moe_compile.train.loop import train_step
from moe_compile.train.optimizer import OLMoDDPOptimizer

from .common import build_model, make_batches
from .harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def trained(seed: int = 0, steps: int = 2, **kw):
    cm = moe_compile(build_model("tiny", seed=seed, **kw))
    opt = OLMoDDPOptimizer(cm, lr=1e-2, weight_decay=0.01)
    for s in range(steps):
        train_step(cm, opt, make_batches(1, seed=s))
    return cm, opt


def snapshot(cm, opt) -> tuple:
    bufs = {k: v.clone() for k, v in cm.model.state_dict().items()}
    return cm.full_state_dict(), opt.full_state(), opt.step_count, bufs


def same(a: tuple, b: tuple) -> bool:
    return (all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and all(torch.equal(a[1][k][j], b[1][k][j]) for k in a[1] for j in a[1][k])
            and a[2] == b[2] and all(torch.equal(a[3][k], b[3][k]) for k in a[3]))


def fail_at(where: str):
    def hook(stage: str) -> None:
        if stage == where:
            raise RuntimeError(f"injected crash at {stage}")
    return hook


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    at2 = snapshot(cm, opt)
    train_step(cm, opt, make_batches(1, seed=7))
    with pytest.raises(RuntimeError, match="injected crash at written"):
        save_checkpoint(tmp_path, cm, opt, step=3, data_position=3, _fault=fail_at("written"))
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    assert (tmp_path / ".step_00000003.partial").is_dir()  # the interrupted save's files, never referenced

    assert not same(snapshot(cm, opt), at2)
    state = load_checkpoint(tmp_path, cm, opt)  # back to step 2
    assert (state.step, state.data_position, state.optimizer_step) == (2, 2, 2)
    assert same(snapshot(cm, opt), at2)

    save_checkpoint(tmp_path, cm, opt, step=3, data_position=3, keep_last=1)
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003"]


def test_resave_interrupted_between_renames_keeps_a_loadable_copy(tmp_path, monkeypatch):
    """Re-saving a step moves the committed copy aside first; a crash before the new one takes its place
    leaves latest -> step_N missing: the copy beside it is what latest_checkpoint (and a resume) finds."""
    from moe_compile.train import checkpoint

    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    at2 = snapshot(cm, opt)
    train_step(cm, opt, make_batches(1, seed=7))
    rename = os.rename

    def killed(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt("killed between the renames")
        return rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    monkeypatch.setattr(checkpoint.os, "rename", rename)
    assert not (tmp_path / "step_00000002").exists()
    assert latest_checkpoint(tmp_path).name == ".step_00000002.old"
    assert load_checkpoint(tmp_path, cm, opt).step == 2 and same(snapshot(cm, opt), at2)
    save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)  # the next save of it tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]


def test_keep_last_and_latest_follow_the_commit_order(tmp_path):
    """Another run saved higher steps into the same root: keep_last keeps this run's last saves, and
    without the pointer the newest commit is the latest, not the highest step."""
    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=40, data_position=40)
    for step in (3, 6, 9):
        save_checkpoint(tmp_path, cm, opt, step=step, data_position=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000006", "step_00000009"]
    save_checkpoint(tmp_path, cm, opt, step=40, data_position=40)  # a higher step, saved last
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000040"
    save_checkpoint(tmp_path, cm, opt, step=12, data_position=12)
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000012"


def test_a_crash_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """keep_last removes older checkpoints after the commit; killed part-way through one removal, no
    step_* directory may be left that looks complete (its manifest there) but lacks files."""
    from moe_compile.train import checkpoint

    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    rmtree = shutil.rmtree

    def killed(path, *a, **kw):  # deletes one data file of the checkpoint, then the process "dies"
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt("killed while pruning")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, cm, opt, step=3, data_position=3, keep_last=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    for p in tmp_path.glob("step_*"):  # every checkpoint that looks complete is complete
        checkpoint.verify_checkpoint(p)
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    save_checkpoint(tmp_path, cm, opt, step=4, data_position=4, keep_last=1)  # the next save tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004"]


def test_resume_with_dropout_continues_the_random_stream(tmp_path):
    """Dropout draws from each rank's generator: a run resumed from a checkpoint (in a process whose
    generator is elsewhere) must draw the masks the uninterrupted run drew, so its losses are the same."""
    from moe_compile.train import rng_state

    def build():
        cm = moe_compile(build_model("olmoe", attention_dropout=0.3))
        return cm, OLMoDDPOptimizer(cm, lr=1e-2)

    batches = [make_batches(1, seed=s) for s in range(4)]
    cm, opt = build()
    ref = []
    for s in range(4):
        ref.append(train_step(cm, opt, batches[s])[0].item())
        if s == 1:
            save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    cm, opt = build()
    torch.manual_seed(12345)
    load_checkpoint(tmp_path, cm, opt)
    assert [train_step(cm, opt, batches[s])[0].item() for s in (2, 3)] == ref[2:]
    # Under another world size no saved state is a rank's own: a seed from the saved states and the
    # rank, the same every time for a rank, different between ranks.
    states = rng_state.read(tmp_path / "step_00000002") * 2
    draws = []
    for rank in (0, 0, 1):
        assert rng_state.restore(states, world=3, rank=rank) == "reseeded"
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_a_failed_step_leaves_no_gradient_for_the_next():
    """train_step raising in its second microbatch (an out-of-vocabulary id) must not leave the first
    microbatch's gradient for the next step: that step then equals the same step on a fresh copy."""
    import copy

    from moe_compile.errors import OptionError

    model = build_model("tiny")
    good = make_batches(2, seed=1)
    bad = [make_batches(1, seed=2)[0], make_batches(1, seed=3)[0].clone()]
    bad[1][0, 3] = 10_000
    ref = moe_compile(copy.deepcopy(model), microbatches=2)
    ref_opt = OLMoDDPOptimizer(ref, lr=1e-2)
    train_step(ref, ref_opt, good)
    cm = moe_compile(copy.deepcopy(model), microbatches=2)
    opt = OLMoDDPOptimizer(cm, lr=1e-2)
    with pytest.raises(OptionError, match="input_ids hold token id 10000"):
        train_step(cm, opt, bad)
    train_step(cm, opt, good)
    a, b = ref.full_state_dict(), cm.full_state_dict()
    assert opt.step_count == 1 and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fresh_run_refuses_a_directory_with_checkpoints_and_resume_drops_a_cut_row(tmp_path, monkeypatch):
    from moe_compile.errors import OptionError
    from moe_compile.train.loop import TrainConfig, _metrics_sink, check_ckpt_dir

    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    with pytest.raises(OptionError, match=r"already holds checkpoints \(newest: step_00000002\): pass --resume"):
        check_ckpt_dir(TrainConfig(ckpt=str(tmp_path)), 0)
    check_ckpt_dir(TrainConfig(ckpt=str(tmp_path), resume=True), 0)
    rows = tmp_path / "m.jsonl"
    rows.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')  # killed mid-row
    cut = rows.read_text()

    def crash(*a):  # killed while the trimmed rows are being written: the old file must stand
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr("moe_compile.train.loop.os.replace", crash)
        with pytest.raises(KeyboardInterrupt):
            _metrics_sink(str(rows), 3)
    assert rows.read_text() == cut
    _metrics_sink(str(rows), 3).close()
    assert rows.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert sorted(f.name for f in tmp_path.glob("m.jsonl*")) == ["m.jsonl"]
    rows.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(OptionError, match="line 2 is not JSON"):
        _metrics_sink(str(rows), 2)


def test_mismatched_and_truncated_checkpoints_fail_clearly(tmp_path):
    cm, opt = trained()
    save_checkpoint(tmp_path / "a", cm, opt, step=2, data_position=2)
    ck = latest_checkpoint(tmp_path / "a")

    other, oopt = trained(seed=1, steps=1, num_experts=4)
    before = snapshot(other, oopt)
    with pytest.raises(CheckpointError, match=r"does not match the compiled model.*experts\.gate_up_proj"):
        load_checkpoint(ck, other, oopt)
    assert same(snapshot(other, oopt), before)

    tgt, topt = cm, opt  # trained on past the checkpoint: a load would change it
    train_step(tgt, topt, make_batches(1, seed=9))
    before = snapshot(tgt, topt)
    bad = tmp_path / "t" / ck.name
    shutil.copytree(ck, bad)
    data = max(bad.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 10)
    with pytest.raises(CheckpointError, match=rf"truncated.*{data.name} has {size // 10} bytes.*says {size}"):
        load_checkpoint(bad, tgt, topt)
    assert same(snapshot(tgt, topt), before)

    # The manifest agreeing with the damaged file: the read itself fails, still before anything is adopted.
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["files"][data.name] = size // 10
    manifest["sha256"][data.name] = file_sha256(data)
    manifest["manifest_sha256"] = _manifest_sha256(manifest)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="could not be read.*nothing was loaded"):
        load_checkpoint(bad, tgt, topt)
    assert same(snapshot(tgt, topt), before)

    (bad / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(bad, tgt, topt)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "t", tgt, topt)
    assert same(snapshot(tgt, topt), before)
    load_checkpoint(ck, tgt, topt)  # the intact original still loads, and does change the target
    assert not same(snapshot(tgt, topt), before)


def test_a_model_with_the_same_shapes_but_other_routing_is_refused(tmp_path):
    """Top-k and the score function change what the same tensors compute: such a checkpoint is refused,
    naming the block and the setting; an aux-loss coefficient is a training setting and may change."""
    cm, opt = trained()
    ck = save_checkpoint(tmp_path, cm, opt, step=2, data_position=2)
    for kw, want in ((dict(top_k=4), r"router\.top_k: checkpoint 2, model 4"),
                     (dict(score_func="sigmoid"), r"router\.score_func: checkpoint 'softmax', model 'sigmoid'")):
        other, oopt = trained(seed=1, steps=1, **kw)
        before = snapshot(other, oopt)
        with pytest.raises(CheckpointError, match=r"saved from another model: MoE block layers\.0\.mlp differs .*"
                                                  + want + r".*nothing was loaded"):
            load_checkpoint(ck, other, oopt)
        assert same(snapshot(other, oopt), before)
    other, oopt = trained(seed=1, steps=1, lb_coef=0.05)
    assert load_checkpoint(ck, other, oopt).step == 2
    assert same(snapshot(other, oopt), snapshot(cm, opt))
    # How the source model stores its experts, and which module its class came from (a trust_remote_code
    # model's module path holds its revision), are not what the tensors compute: these load.
    model = build_model("tiny", seed=1, expert_layout="stacked")
    model.__class__ = type(type(model).__name__, (type(model),), {"__module__": "copied_dir.modeling"})
    other = moe_compile(model)
    oopt = OLMoDDPOptimizer(other, lr=1e-2, weight_decay=0.01)
    assert load_checkpoint(ck, other, oopt).step == 2
    x = make_batches(1, seed=5)[0]
    with torch.no_grad():
        assert other(input_ids=x, labels=x).loss.item() == cm(input_ids=x, labels=x).loss.item()


def flip_bit(path: Path, at: int | None = None) -> None:
    """Flip one bit of the byte in the middle of ``path`` (or at ``at``): same size, other content."""
    size = path.stat().st_size
    at = size // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x08]))
    assert path.stat().st_size == size


def test_bit_flip_is_caught_by_checksum_before_anything_is_loaded(tmp_path, caplog):
    cm, opt = trained()
    save_checkpoint(tmp_path / "a", cm, opt, step=2, data_position=2)
    ck = latest_checkpoint(tmp_path / "a")
    at2 = snapshot(cm, opt)

    train_step(cm, opt, make_batches(1, seed=9))  # past the checkpoint: any load would change the state
    before = snapshot(cm, opt)
    for victim in ("data", ".metadata"):
        bad = tmp_path / victim / ck.name
        shutil.copytree(ck, bad)
        f = max(bad.glob("*.distcp"), key=lambda p: p.stat().st_size) if victim == "data" else bad / ".metadata"
        flip_bit(f)
        with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(bad))} is damaged: file "
                                                  rf"{re.escape(f.name)} has SHA-256 .*nothing was loaded"):
            load_checkpoint(bad, cm, opt)
        assert same(snapshot(cm, opt), before), victim  # nothing half-loaded

    # The manifest's own fields are covered too: a changed step is not taken at its word.
    bad = tmp_path / "manifest" / ck.name
    shutil.copytree(ck, bad)
    text = (bad / MANIFEST).read_text()
    (bad / MANIFEST).write_text(text.replace('"step": 2,', '"step": 3,', 1))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bad))} is damaged: {MANIFEST} does not match"):
        load_checkpoint(bad, cm, opt)
    assert same(snapshot(cm, opt), before)

    state = load_checkpoint(ck, cm, opt)  # the clean checkpoint still loads: back to step 2 exactly
    assert (state.step, state.data_position, state.optimizer_step) == (2, 2, 2)
    assert same(snapshot(cm, opt), at2)
    manifest = json.loads((ck / MANIFEST).read_text())
    assert sorted(manifest["sha256"]) == sorted(manifest["files"])  # every file, .metadata included
    assert all(file_sha256(ck / rel) == h for rel, h in manifest["sha256"].items())

    # A manifest from before checksums (sizes only) still loads, with a warning.
    legacy = tmp_path / "legacy" / ck.name
    shutil.copytree(ck, legacy)
    (legacy / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items()
                                               if k not in ("sha256", "manifest_sha256")}))
    train_step(cm, opt, make_batches(1, seed=9))
    with caplog.at_level(logging.WARNING, logger="moe_compile.train"):
        load_checkpoint(legacy, cm, opt)
    assert same(snapshot(cm, opt), at2)
    assert any("has no file checksums" in r.getMessage() for r in caplog.records), caplog.records


FROZEN_DENSE = ("embed.weight", "layers.0.mlp.router.weight")
FROZEN_EXPERT = "layers.1.mlp.experts.down_proj"


def frozen(seed: int, mesh: str):
    """The tiny model with two dense parameters frozen before compiling and one expert parameter
    after (the canonical expert tensors are new parameters), and an optimizer over the rest."""
    model = build_model("tiny", seed=seed)
    for n in FROZEN_DENSE:
        model.get_parameter(n).requires_grad_(False)
    cm = moe_compile(model, MeshSpec.parse(mesh))
    cm.model.get_parameter(FROZEN_EXPERT).requires_grad_(False)
    opt = OLMoDDPOptimizer(cm, lr=1e-2, weight_decay=0.01)
    return cm, opt


def tensors_out(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def frozen_worker(rank, world, mesh, ckpt, saved):
    """``saved`` None: freeze, perturb the frozen values, train, save, then resume a fresh model (other
    random init) on the same mesh and try a bit-flipped copy. Else: resume from ``ckpt`` on ``mesh``."""
    out = {}
    if saved is None:
        cm, opt = frozen(0, mesh)
        names = {FROZEN_EXPERT, *FROZEN_DENSE}
        with torch.no_grad():  # frozen values no init reproduces
            for n in sorted(names):
                cm.model.get_parameter(n).mul_(-3.0).add_(0.25)
        out["frozen_in_optimizer"] = sorted(names & set(opt.slots))
        perturbed = cm.full_state_dict()
        dp_rank = cm.program.mesh.dense_coords(rank)[1]
        for s in range(2):
            train_step(cm, opt, make_batches(world, seed=s)[dp_rank: dp_rank + 1])
        after = cm.full_state_dict()
        out["frozen_stayed"] = all(torch.equal(after[k], perturbed[k]) for k in after
                                   if k in FROZEN_DENSE or k.startswith("layers.1.mlp.experts.") and ".w2." in k)
        out["trained_moved"] = not torch.equal(after["lm_head.weight"], perturbed["lm_head.weight"])
        save_checkpoint(ckpt, cm, opt, step=2, data_position=2 * world)
        out["saved"] = {"params": after, "optim": opt.full_state()}
        saved = out["saved"]
        # A bit flip in the data file rank 1 wrote: whichever rank hashes it, every rank raises naming it.
        ck = latest_checkpoint(ckpt)
        bad = Path(ckpt).parent / "flipped" / ck.name
        if rank == 0:
            shutil.copytree(ck, bad)
            flip_bit(bad / f"__{world - 1}_0.distcp")
        torch.distributed.barrier()
        train_step(cm, opt, make_batches(world, seed=5)[dp_rank: dp_rank + 1])
        before = {"params": cm.full_state_dict(), "optim": opt.full_state()}
        try:
            load_checkpoint(bad, cm, opt)
            out["flip_error"] = "loaded"
        except CheckpointError as e:
            out["flip_error"] = str(e)
        out["flip_untouched"] = state_equal({"params": cm.full_state_dict(), "optim": opt.full_state()}, before)
    cm, opt = frozen(1, mesh)  # a fresh model, other random init
    fresh = cm.full_state_dict()
    out["was_different"] = sorted(n for n in saved["params"] if not torch.equal(fresh[n], saved["params"][n]))
    state = load_checkpoint(ckpt, cm, opt)
    out["loaded_step"] = (state.step, state.optimizer_step)
    got = {"params": cm.full_state_dict(), "optim": opt.full_state()}
    out["differ_after_load"] = [n for n in saved["params"] if not torch.equal(got["params"][n], saved["params"][n])]
    out["optim_equal"] = state_equal({"params": {}, "optim": got["optim"]}, {"params": {}, "optim": saved["optim"]})
    return tensors_out(out if rank == 0 else {k: v for k, v in out.items() if k.startswith("flip_")})


def state_equal(a: dict, b: dict) -> bool:
    return (a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
            and all(torch.equal(a["params"][n], b["params"][n]) for n in b["params"])
            and all(torch.equal(a["optim"][n][k], b["optim"][n][k]) for n in b["optim"] for k in b["optim"][n]))


@pytest.mark.slow
def test_frozen_parameters_are_restored_on_another_mesh(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    a, a1 = (torch.load(io.BytesIO(r), weights_only=False) for r in run_ranks(frozen_worker, 2, "ep_mp=2", ckpt, None))
    assert a["frozen_in_optimizer"] == [], a["frozen_in_optimizer"]
    assert a["frozen_stayed"] and a["trained_moved"], a
    assert "damaged: file __1_0.distcp has SHA-256" in a["flip_error"], a["flip_error"]
    assert "flipped" in a["flip_error"] and "nothing was loaded" in a["flip_error"], a["flip_error"]
    assert a1["flip_error"] == a["flip_error"], a1  # one rank hashed the file; both raise the same error
    assert a["flip_untouched"] and a1["flip_untouched"]
    saved = a["saved"]
    frozen_names = [n for n in saved["params"] if n in FROZEN_DENSE
                    or n.startswith("layers.1.mlp.experts.") and ".w2." in n]
    assert len(frozen_names) == len(FROZEN_DENSE) + 8, frozen_names  # + the 8 experts' down projections
    one = torch.load(io.BytesIO(run_ranks(frozen_worker, 1, "", ckpt, saved)[0]), weights_only=False)
    for r, where in ((a, "ep_mp=2, 2 ranks"), (one, "ep_mp=1, 1 rank")):
        assert set(frozen_names) <= set(r["was_different"]), (where, r["was_different"])
        assert r["loaded_step"] == (2, 2), (where, r["loaded_step"])
        assert r["differ_after_load"] == [], (where, r["differ_after_load"])  # every parameter, frozen included
        assert r["optim_equal"], where


def bf16_worker(rank, world):
    """One rank with torch.distributed up, so the multi-group DDP and its buckets are in play."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("moe_compile.train").addHandler(Keep())
    cm = moe_compile(build_model("tiny").to(torch.bfloat16), MeshSpec())
    opt = OLMoDDPOptimizer(cm, lr=1e-5, weight_decay=0.0)
    out = {"buckets": sorted({b["dtype"] for b in cm.ddp.bucket_summary()})}
    main0 = {n: s["main"].clone() for n, s in opt.full_state().items()}
    params0 = {n: p.detach().clone() for n, p in cm.model.named_parameters()}
    a, b = make_batches(1, seed=1)[0], make_batches(1, seed=2)[0]
    with cm.no_sync():
        cm(a, labels=a).loss.backward()
    cm(b, labels=b).loss.backward()
    p = cm.model.lm_head.weight
    out["grad_moved"] = p.grad is None and cm.ddp.main_grad(p).dtype == torch.float32
    out["grad_nonzero"] = bool(cm.ddp.main_grad(p).abs().sum() > 0)
    res = opt.step()
    opt.zero_grad()
    st = opt.full_state()
    out["applied"] = not res.skipped and opt.step_count == 1
    out["main_fp32"] = all(st[n]["main"].dtype == torch.float32 for n in st)
    out["copy_back_exact"] = all(torch.equal(q, st[n]["main"].to(torch.bfloat16))
                                 for n, q in cm.model.named_parameters())
    moved = [n for n in st if not torch.equal(st[n]["main"], main0[n])]
    out["main_moved"] = len(moved) == len(st)
    # lr 1e-5 moves FP32 main weights by less than BF16 resolves: most compute weights are unchanged
    n_same = sum(int((q == params0[n]).sum()) for n, q in cm.model.named_parameters())
    out["bf16_unchanged_fraction"] = n_same / sum(q.numel() for q in cm.model.parameters())

    before = (opt.full_state(), {n: q.clone() for n, q in cm.model.named_parameters()})
    cm(a, labels=a).loss.backward()
    cm.ddp.main_grad(cm.model.embed.weight)[3, 5] = float("inf")
    res = opt.step()
    opt.zero_grad()
    after = (opt.full_state(), dict(cm.model.named_parameters()))
    out["skipped"] = res.skipped and opt.step_count == 1 and opt.skipped_steps == 1
    out["untouched"] = (all(torch.equal(before[0][n][k], after[0][n][k]) for n in before[0] for k in before[0][n])
                        and all(torch.equal(before[1][n], after[1][n]) for n in before[1]))
    out["logged"] = records
    return out


@pytest.mark.slow
def test_bf16_compute_weights_fp32_main_and_nonfinite_skip():
    r = run_ranks(bf16_worker, 1)[0]
    assert r["buckets"] == ["torch.float32"], r
    assert r["grad_moved"] and r["grad_nonzero"], r
    assert r["applied"] and r["main_fp32"] and r["main_moved"], r
    assert r["copy_back_exact"], r
    assert r["bf16_unchanged_fraction"] > 0.5, r
    assert r["skipped"] and r["untouched"], r
    assert any("skipped: non-finite gradient norm inf" in m for m in r["logged"]), r["logged"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_compile.cli", "train", "--ranks", "2", "--mesh", "ep_mp=2", "--seq-len", "32",
            "--steps", "40", "--no-progress", *args]


def losses(path: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow
def test_kill_9_then_resume_is_bitwise_identical(tmp_path):
    ck, ref, run = tmp_path / "ck", tmp_path / "ref.jsonl", tmp_path / "run.jsonl"
    logs = [open(tmp_path / f"{n}.log", "w") for n in ("ref", "killed")]
    uninterrupted = subprocess.Popen(cli("--metrics-jsonl", str(ref)), cwd=ROOT, stdout=logs[0], stderr=logs[0])
    victim = subprocess.Popen(cli("--ckpt", str(ck), "--save-every", "3", "--metrics-jsonl", str(run)), cwd=ROOT,
                              stdout=logs[1], stderr=logs[1], start_new_session=True)
    deadline = time.time() + 400
    while latest_checkpoint(ck) is None:
        assert victim.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.005)
    os.killpg(victim.pid, signal.SIGKILL)  # the launcher and its ranks, mid-run
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert uninterrupted.wait(timeout=400) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    steps_before_kill = len(losses(run))
    assert steps_before_kill < 40

    proc = subprocess.run(cli("--ckpt", str(ck), "--save-every", "3", "--resume", "--metrics-jsonl", str(run)),
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "(resumed at step" in proc.stdout, proc.stdout
    assert losses(run) == losses(ref)  # every step's loss and grad norm, bit for bit
    assert [r[0] for r in losses(run)] == list(range(1, 41))


def test_bad_save_arguments_are_refused_and_a_damaged_latest_pointer_falls_back(tmp_path):
    """A negative step would be written as step_-0000001 and never found again (and resume would load an
    older state silently); keep_last < 1 would prune what was just saved. Both refused before anything is
    written. A ``latest`` pointer with undecodable bytes falls back to the last committed checkpoint."""
    cm, opt = trained()
    save_checkpoint(tmp_path, cm, opt, step=1, data_position=1)
    for kw, match in ((dict(step=-1), "step=-1 must be an int >= 0"), (dict(step=2.0), "step=2.0 must be an int"),
                      (dict(step=2, keep_last=0), "keep_last=0 must be None"),
                      (dict(step=2, keep_last=-1), "keep_last=-1 must be None")):
        with pytest.raises(CheckpointError, match=match):
            save_checkpoint(tmp_path, cm, opt, data_position=2, **{"keep_last": None, **kw})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    (tmp_path / "latest").write_bytes(b"\xff\xfe step_0000")
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert load_checkpoint(tmp_path, cm, opt).step == 1


def unpreparable_root_worker(rank, world, root):
    """The root is a regular file: rank 0 cannot create it. Every rank raises CheckpointError at once (rank 0
    raised a raw FileExistsError and rank 1 waited in the save's barrier until the collective timeout)."""
    cm = moe_compile(build_model("tiny"), MeshSpec.parse("ep_mp=2"))
    opt = OLMoDDPOptimizer(cm, lr=1e-2)
    t = time.monotonic()
    try:
        save_checkpoint(root, cm, opt, step=1, data_position=1)
        msg = "no error"
    except CheckpointError as e:
        msg = str(e)
    cm.close()
    return {"msg": msg, "seconds": time.monotonic() - t}


def test_a_root_rank_0_cannot_create_fails_on_every_rank(tmp_path):
    root = tmp_path / "a_file"
    root.write_text("not a directory")
    for r in run_ranks(unpreparable_root_worker, 2, str(root), timeout=120):
        assert "rank 0 could not prepare" in r["msg"] and "FileExistsError" in r["msg"], r
        assert "previous checkpoint is untouched" in r["msg"] and r["seconds"] < 60, r
    assert root.read_text() == "not a directory"


def pp_tied_worker(rank, world, root, phase):
    model = build_model("tiny", max_seq_len=16 if phase == "short" else 256)
    model.layers[1].mlp_norm.weight = model.layers[1].attn_norm.weight  # tied within stage 1
    cm = moe_compile(model, MeshSpec.parse("pp=2").resolve(world), microbatches=2, schedule="1f1b")
    opt = OLMoDDPOptimizer(cm, lr=1e-2)
    b = make_batches(1, 4, 16, seed=3)[0]
    if phase == "save":
        cm.train_step(input_ids=b, labels=b)
        opt.step()
        save_checkpoint(root, cm, opt, 1, 0)
        return cm.full_state_dict()
    try:
        load_checkpoint(root, cm, opt)
    except CheckpointError as e:
        return str(e)
    return cm.full_state_dict()


def test_pipeline_checkpoint_with_tied_weights_and_one_verdict(tmp_path):
    """pp=2: the stage that does not hold two weights tied within the other stage listed one of their
    checkpoint keys as foreign, not both, refused the checkpoint alone and left its peer waiting in the
    load's collective (a hang). It now loads every tensor as saved; and a checkpoint that only one stage
    can refuse (a position table of 256 rows, the model's of 16: stage 0's) is refused on every rank."""
    root = tmp_path / "ck"
    saved = run_ranks(pp_tied_worker, 2, root, "save")
    loaded = run_ranks(pp_tied_worker, 2, root, "load")
    for s, got in zip(saved, loaded):
        assert set(s) == set(got) and all(torch.equal(s[k], got[k]) for k in s), sorted(set(s) ^ set(got))
    refused = run_ranks(pp_tied_worker, 2, root, "short", timeout=120)
    assert "pos.weight: checkpoint (256, 64), model (16, 64)" in refused[0], refused[0]
    assert "does not match the compiled model on another rank" in refused[1], refused[1]
