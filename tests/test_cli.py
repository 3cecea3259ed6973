"""`moe-compile train`: spawns its own ranks, shows progress, writes per-step JSONL, ends with a summary.
(Checkpointing and --resume through the CLI: tests/test_checkpoint.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_train_two_ranks_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.cli", "train", "--steps", "4", "--ranks", "2", "--mesh", "ep_mp=2",
         "--seq-len", "32", "--metrics-jsonl", str(metrics), "--precision", "bf16", "--grad-accum", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all({"step", "loss", "grad_norm", "tokens", "seconds"} <= set(r) for r in rows)
    assert all(r["tokens"] == 4 * 32 * 2 * 2 for r in rows)  # batch · seq · dp · m
    assert not any(r["skipped"] for r in rows)
    assert "step    4/4 | loss" in proc.stdout and "tok/s" in proc.stdout
    assert "done: tiny on mesh dp=2,cp=1,pp=1,ep_dp=1,ep_mp=2 (2 ranks), 4 steps" in proc.stdout
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.long(2)
def test_train_context_parallel_matches_one_rank(tmp_path):
    """`train --mesh cp=2` refused the tiny model (its in-block router losses would see one sequence shard),
    then trained only with --no-router-aux-loss; its blocks now gather the CP group's router logits, and
    the two sequence shards train as one rank does, load-balancing and z losses included."""
    def run(*args: str) -> list[dict]:
        metrics = tmp_path / f"m{len(args)}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "train", "--steps", "3", "--seq-len", "32",
                               "--no-progress", "--metrics-jsonl", str(metrics), *args],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    cp, one = run("--mesh", "cp=2", "--ranks", "2"), run()
    assert [r["tokens"] for r in cp] == [r["tokens"] for r in one]
    for a, b in zip(cp, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                 rel=1e-4)


@pytest.mark.slow
def test_train_hf_family_single_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.cli", "train", "--steps", "2", "--hf", "qwen2_moe", "--seq-len", "16"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: qwen2_moe on mesh" in proc.stdout


@pytest.mark.slow
def test_train_recompute_option_keeps_the_losses(tmp_path):
    """--activation-checkpointing reaches the compiled program (the summary counts the ops its backward
    graph recomputes), and the losses and grad norms stay those of the plain run."""
    from .common import cli_train, metric_rows

    plain = cli_train(tmp_path, 1, "", 3, "plain.jsonl")
    sel = cli_train(tmp_path, 1, "", 3, "sel.jsonl", "--activation-checkpointing", "selective")
    assert "recompute" not in plain and "dense fusion" not in plain, plain
    assert int(sel.split("recompute selective (")[1].split(" ops)")[0]) > 0, sel
    a, b = metric_rows(tmp_path / "plain.jsonl"), metric_rows(tmp_path / "sel.jsonl")
    assert [r[0] for r in a] == [r[0] for r in b] == [1, 2, 3]
    for (_, la, ga), (_, lb, gb) in zip(a, b):
        assert abs(la - lb) <= 1e-5 * abs(la) and abs(ga - gb) <= 1e-4 * abs(ga), (a, b)


def test_train_compile_options_reach_the_program():
    """The train command's --dense-fusion / --activation-checkpointing become the program's options
    (inductor itself is tested in tests/test_dense_fusion.py; a cold compile here would cost a minute)."""
    import argparse

    from moe_compile.cli import _config, _train_parser
    from moe_compile.train.loop import build_model, compile_for

    parser = argparse.ArgumentParser()
    _train_parser(parser.add_subparsers(dest="command"))
    cfg = _config(parser.parse_args(["train", "--dense-fusion", "inductor", "--activation-checkpointing", "full"]))
    cm = compile_for(cfg, build_model(cfg))
    assert (cm.program.options.dense_fusion, cm.program.options.activation_checkpointing) == ("inductor", "full")
    cm.close()
    cfg = _config(parser.parse_args(["train"]))
    assert (cfg.dense_fusion, cfg.activation_checkpointing) == ("auto", None)
    with pytest.raises(SystemExit):  # argparse names the choices on stderr
        parser.parse_args(["train", "--dense-fusion", "fast"])


def test_bad_mesh_is_reported(tmp_path):
    """Exit 2 before any rank starts, naming the rule (it used to start the ranks, print every rank's
    traceback and exit 1)."""
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.cli", "train", "--steps", "1", "--ranks", "1", "--mesh", "dp=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert "but the world has 1" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bad_training_options_are_reported(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "train", "--save-every", "5"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--resume and --save-every need --ckpt DIR" in proc.stderr, proc.stderr
    from moe_compile.cli import main

    # refused before any rank is spawned or step trained (in-process: main returns 2 at once)
    (tmp_path / "afile").write_text("")
    assert main(["train", "--log-every", "0"]) == 2
    assert main(["train", "--ckpt", str(tmp_path / "afile" / "ck")]) == 2
    # NaN passes `x < 0`: it reached the ranks and turned every weight NaN (lr) or switched clipping off
    (tmp_path / "short.txt").write_text("abc")
    for bad in (["--lr", "nan"], ["--max-grad-norm", "nan"], ["--seq-len", "1"], ["--batch-size", "0"],
                ["--data", str(tmp_path / "missing.txt")], ["--data", str(tmp_path / "short.txt")]):
        assert main(["train", *bad]) == 2, bad
    err = capsys.readouterr().err
    assert f"--data {tmp_path / 'missing.txt'}: cannot read it (No such file or directory)" in err, err
    assert f"--data {tmp_path / 'short.txt'}: 3 bytes is shorter than one sequence" in err, err
    assert "--lr nan, --weight-decay 0.0: must be finite and ≥ 0" in err, err
    assert "--max-grad-norm nan: must be ≥ 0" in err, err
    assert "--log-every 0: must be ≥ 1" in err, err
    assert f"--ckpt {tmp_path / 'afile' / 'ck'}: not a writable directory (NotADirectoryError" in err, err


def test_failure_summary_names_the_cause_not_the_dynamo_hint():
    """A rank's error raised inside torch.compile ends its traceback with dynamo's TORCHDYNAMO_VERBOSE
    hint; the one-line summary showed that hint instead of the error."""
    import traceback

    import torch

    from moe_compile.cli import failure_cause

    def backend(gm, example_inputs):
        raise ValueError("expert weight shape (8, 3) is not (8, 4)")

    try:
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    except Exception:
        text = traceback.format_exc()
    assert "TORCHDYNAMO_VERBOSE" in text.strip().splitlines()[-1]  # the hint is the last line
    assert failure_cause(text) == "ValueError: expert weight shape (8, 3) is not (8, 4)"
    assert failure_cause("just a message\n") == "just a message"


def test_families_prints_the_table():
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "families", "mixtral", "afmoe", "phimoe"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["family", "status", "detail"]
    rows = {ln.split()[0]: ln.split()[1] for ln in lines[1:-1]}
    assert rows == {"mixtral": "compiled", "afmoe": "compiled", "phimoe": "error"}, proc.stdout
    assert "model.layers.0.mlp.router" in proc.stdout and "custom autograd Function" in proc.stdout
    assert lines[-1] == "2 compiled, 1 error, 0 wrong, 0 crash of 3 families"


def test_families_rejects_unknown_names():
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "families", "llama"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "not MoE causal-LM families" in proc.stderr and "'llama'" in proc.stderr


def test_families_and_train_refuse_bad_arguments_before_any_rank_starts(capsys):
    """A mesh typo made every family an "error" row and exited 0; --ranks 0 an IndexError; a tiny-model
    width the attention heads do not split failed inside dynamo on every rank; --capacity-factor nan
    reached the ranks. Each is now exit 2 at once, naming the argument."""
    from moe_compile.cli import main

    cases = ((["families", "olmoe", "--mesh", "tp=2"], "tp"), (["families", "olmoe", "--ranks", "0"], "--ranks 0"),
             (["train", "--d-model", "30"], "--d-model 30"), (["train", "--capacity-factor", "nan"], "--capacity-factor nan"),
             (["train", "--d-model", "0"], "--d-model 0"),
             (["train", "--schedule", "gpipe"], "--schedule gpipe: the mesh has pp=1"),  # was ignored  # were a ZeroDivisionError / negative size on every rank
             (["train", "--hf", "olmoe", "--d-model", "36"], "multiple of 8"),  # was a rotary / grouped_mm crash
             (["train", "--mesh", "foo=2", "--ranks", "2"], "foo=2"),
             (["train", "--mesh", "ep_mp=4", "--ranks", "2"], "ep_mp=4 does not divide"))
    for args, message in cases:
        assert main(args) == 2, args
        assert message in capsys.readouterr().err, args
