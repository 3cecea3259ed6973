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


@pytest.mark.slow
def test_train_hf_family_single_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.cli", "train", "--steps", "2", "--hf", "qwen2_moe", "--seq-len", "16"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: qwen2_moe on mesh" in proc.stdout


def test_bad_mesh_is_reported(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.cli", "train", "--steps", "1", "--ranks", "1", "--mesh", "dp=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode != 0
    assert "but the world has 1" in proc.stderr


def test_bad_training_options_are_reported():
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "train", "--save-every", "5"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--resume and --save-every need --ckpt DIR" in proc.stderr, proc.stderr


def test_families_prints_the_table():
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "families", "mixtral", "afmoe", "qwen4_exp_text"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["family", "status", "detail"]
    rows = {ln.split()[0]: ln.split()[1] for ln in lines[1:-1]}
    assert rows == {"mixtral": "compiled", "afmoe": "compiled", "qwen4_exp_text": "error"}, proc.stdout
    assert "model.layers.1.self_attn.indexer" in proc.stdout and "data-dependent Python control flow" in proc.stdout
    assert lines[-1] == "2 compiled, 1 error, 0 wrong, 0 crash of 3 families"


def test_families_rejects_unknown_names():
    proc = subprocess.run([sys.executable, "-m", "moe_compile.cli", "families", "llama"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "not MoE causal-LM families" in proc.stderr and "'llama'" in proc.stderr
