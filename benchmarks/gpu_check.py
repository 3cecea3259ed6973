"""GPU check, one run (< 8 minutes on one H200): everything the CPU machines cannot verify.

    python benchmarks/gpu_check.py --out DIR [--budget 460] [--only PART ...]
    python benchmarks/gpu_check.py --smoke --out DIR      # CPU: the parts' CPU fallbacks, tiny sizes

Parts, in this order, each in its own subprocess with its own timeout (capped by what is left of
``--budget`` seconds), each writing DIR/<part>.json (status ok | failed | timeout | skipped | error,
its result, seconds, the log's tail; the whole log in DIR/<part>.log), then DIR/summary.json:

  env           versions and probes: python, torch (CUDA build), triton, nvshmem4py, cuda.core (which
                import path), torchao, GPU name / capability / memory, nvidia-smi
  nvshmem       a 1-PE NVSHMEM heap + symmetric transport round trip: dispatch → combine returns
                every row (the counts exchange and the barriers on torch's stream included), a second
                heap sharing the one NVSHMEM init, the size check, one finalize at the last close
  train_step    one compiled training step, codegen="triton", one rank, tiny model (models/tiny.py)
                vs the dense model: loss and every gradient
  kernel_tests  pytest tests/test_kernels.py, tests/test_mxfp8.py::test_triton_kernels_under_interpreter
                and tests/test_nvshmem_heap.py with MOE_COMPILE_TEST_DEVICE=cuda (natively compiled
                kernels); counts and failures from its junit xml
  kernel_bench  the benchmarks/gpu_kernels.py table (OLMoE-like shapes), its rows as JSON
  dense_fusion  benchmarks/one_rank_step.py --device cuda (HF eager, torch.compile, dense_fusion "none" and
                "inductor"): the measurement that chooses dense_fusion="auto" on CUDA (codegen/dense_fusion.py)

Tolerances (train_step, loss relative / gradients rel_err of each tensor's max): CPU interpreter
1e-6 / 1e-5 (as tests/test_codegen.py); CUDA 1e-5 / 1e-4 — the dense reference runs cuBLAS GEMMs
and atomic index_add_ (no fixed summation order), the program Triton GEMMs, fp32 without TF32.

``--smoke`` (CPU, tests/test_benchmarks.py): env; nvshmem on the host shared-memory heap, plus the
NVSHMEM heap's "needs a CUDA device" refusal; train_step on the Triton interpreter at a tiny size;
kernel_tests on a few interpreter tests; kernel_bench skipped (``gpu_kernels.py --smoke`` is run by
tests/test_codegen.py); dense_fusion skipped (on CPU, one_rank_step.py is the README's own benchmark).
Without a GPU (and without --smoke) it says so, writes summary.json and exits 0. Exit status: 0 when
every part that ran passed (dense_fusion may be cut by the budget: it only measures), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
PARTS = ("env", "nvshmem", "train_step", "kernel_tests", "kernel_bench", "dense_fusion")
TIMEOUT_S = {"env": 45, "nvshmem": 90, "train_step": 150, "kernel_tests": 240, "kernel_bench": 200,
             "dense_fusion": 240}
SMOKE_TIMEOUT_S = {"env": 120, "nvshmem": 180, "train_step": 300, "kernel_tests": 300, "kernel_bench": 10,
                   "dense_fusion": 10}  # CPU CI under load
TOL = {"cpu": (1e-6, 1e-5), "cuda": (1e-5, 1e-4)}  # (loss relative, gradient rel_err)
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_mxfp8.py::test_triton_kernels_under_interpreter",
                "tests/test_nvshmem_heap.py"]
SMOKE_KERNEL_TESTS = ["tests/test_kernels.py::test_mxfp8_offsets_are_int64_past_2_31", "tests/test_nvshmem_heap.py"]


MEASURE_ONLY = {"dense_fusion"}  # a ratio to record, not a check: the budget may cut it without a failure
SMOKE_SKIP = {"kernel_bench": "the benchmark's own --smoke (interpreter) run is tests/test_codegen.py::"
                              "test_gpu_benchmark_smoke_run_and_no_gpu_message; too slow for this smoke",
              "dense_fusion": "on CPU the measurement is benchmarks/one_rank_step.py itself (README); its "
                              "compiles take minutes"}


class Skip(Exception):
    """A part that does not apply here (its JSON says why)."""


def cuda_syncs(fn):
    """Run fn under torch's CUDA sync debug mode: (fn's result, {site: count} of the device→host
    synchronisations it made). A site is the innermost moe_compile frame ('file:function:line') above
    the synchronising call, else the Python frame the warning names."""
    import collections
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()
    pkg = os.path.join(ROOT, "moe_compile")

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the mode's own "prototype feature" notice
            return
        f, site = sys._getframe(1), f"{os.path.relpath(filename, ROOT)}:{lineno}"
        while f is not None:
            if f.f_code.co_filename.startswith(pkg):
                site = f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_code.co_name}:{f.f_lineno}"
                break
            f = f.f_back
        sites[f"{site}: {str(message).splitlines()[0][:70]}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, dict(sites)


def rel_err(a, b) -> float:
    scale = b.double().abs().max().item() if b.numel() else 0.0
    err = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
    return err / (scale or 1.0)


# -- parts (run in the child process) ---------------------------------------------------------------


def part_env(smoke: bool, out: str) -> dict:
    import importlib
    import importlib.metadata as md

    import torch

    def version(dist_name):
        try:
            return md.version(dist_name)
        except md.PackageNotFoundError:
            return None

    res = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "packages": {n: version(n) for n in ("triton", "torchao", "transformers", "nvshmem4py-cu12",
                                                  "nvshmem4py-cu13", "cuda-core", "cuda-python", "cuda-bindings")}}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError as e:
        res["triton"] = f"not importable: {e}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res.update(device_name=p.name, capability=list(torch.cuda.get_device_capability(0)),
                   device_count=torch.cuda.device_count(), memory_gib=round(p.total_memory / 2**30, 1))
        try:
            res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a probe
            res["nccl"] = f"unavailable: {e}"
    for mod in ("cuda.core", "cuda.core.experimental"):
        try:
            res.setdefault("cuda_core_device", {})[mod] = hasattr(importlib.import_module(mod), "Device")
        except ImportError as e:
            res.setdefault("cuda_core_device", {})[mod] = f"not importable: {e}"
    try:
        import nvshmem.core as nvc  # noqa: F401

        from moe_compile.runtime.symmetric import nvshmem as nv

        res["nvshmem4py"] = getattr(__import__("nvshmem.version", fromlist=["x"]), "__version__", "?")
        res["nvshmem_stream_class"] = hasattr(nvc, "NvshmemStream")
        res["cuda_core_for_heap"] = nv.cuda_core_device().__module__
        try:
            res["libnvshmem"] = str(nvc.get_version())
        except Exception as e:  # noqa: BLE001 - needs the host library; reported, not fatal
            res["libnvshmem"] = f"unavailable: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        res["nvshmem4py"] = f"not importable: {type(e).__name__}: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        res["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        res["nvidia_smi"] = f"unavailable: {e}"
    for k, v in res.items():
        print(f"{k}: {v}")
    res["ok"] = True if smoke else bool(res["cuda_available"])
    return res


def part_nvshmem(smoke: bool, out: str) -> dict:
    """1-PE symmetric heap + transport round trip (the op sequence of benchmarks/transport.py)."""
    import tempfile

    import torch
    import torch.distributed as dist

    import moe_compile  # noqa: F401  (registers the moe:: ops)
    from moe_compile.errors import RuntimeFault
    from moe_compile.runtime import RuntimeContext, RuntimeStats, register_context
    from moe_compile.runtime.lease_runtime import LeaseRuntime
    from moe_compile.runtime.symmetric import make_heap
    from moe_compile.runtime.symmetric import nvshmem as nv
    from moe_compile.runtime.symmetric_transport import SymmetricTransport

    sys.path.insert(0, BENCH)
    from transport import _plan  # the benchmark's hand-made lease plan (dispatch.recv, combine.src, counts)

    device = "cpu" if smoke else "cuda"
    store = tempfile.mkdtemp(prefix="moe_compile_gpu_check_")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    group = dist.group.WORLD
    res: dict = {"device": device}
    refusal = device == "cpu" and not torch.cuda.is_available()
    if refusal:  # without a GPU the NVSHMEM heap refuses clearly; the round trip runs on the host heap
        try:
            nv.NvshmemHeap(group)
            res["no_gpu_error"] = None
        except RuntimeFault as e:
            res["no_gpu_error"] = str(e)
    tokens, d, experts, top_k = 256, 256, 8, 2
    rows = tokens * top_k
    plan = _plan(1, experts, rows, rows, d)
    heap = make_heap(group, device)
    res["heap"] = heap.name
    heap.reserve(int(getattr(plan, "symmetric_bytes", 0) or 0))
    leases = LeaseRuntime(heap, group)
    stats = RuntimeStats()
    ctx = register_context(RuntimeContext(SymmetricTransport(heap, leases, stats), stats, leases=leases))
    leases.activate(leases.install(plan))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g).to(device)
    idx = torch.randint(0, experts, (tokens, top_k), generator=g).to(device)
    xs, _order, counts = torch.ops.moe.permute(x, idx, experts, "bench")
    trips, times = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        recv, recv_counts, layout = torch.ops.moe.dispatch(xs, counts, ctx, "bench", rows, 1)
        landed = torch.equal(recv[:rows], xs) and torch.equal(recv_counts, counts)  # one PE: expert-major = xs
        back = torch.ops.moe.combine(recv, layout, ctx, "bench", rows)
        torch.ops.moe.lease_release(ctx, "bench/dispatch.recv", back)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        trips.append(landed and torch.equal(back, xs))
    res.update(round_trips=trips, round_trip_ms=[round(t, 3) for t in times], rows=rows, d=d,
               heap_allocated_bytes=heap.allocated_bytes, symmetric_bytes=leases.symmetric_bytes)
    ok = all(trips)
    if device == "cuda":  # a 4th round trip, dispatch → combine → release only, under the sync debug mode
        def trip():
            recv, _, layout = torch.ops.moe.dispatch(xs, counts, ctx, "bench", rows, 1)
            back = torch.ops.moe.combine(recv, layout, ctx, "bench", rows)
            torch.ops.moe.lease_release(ctx, "bench/dispatch.recv", back)
            return back
        back, res["round_trip_host_syncs"] = cuda_syncs(trip)
        torch.cuda.synchronize()
        ok = ok and torch.equal(back, xs)
        rt = nv.RUNTIME
        res["runtime"] = {"refs": rt.refs, "inits": rt.inits, "size": rt.size, "allocated": rt.allocated,
                          "NVSHMEM_SYMMETRIC_SIZE": os.environ.get(nv.SIZE_ENV)}
        second = make_heap(group, "cuda")  # a second compiled model in this process
        buf = second.alloc("second", (1024,), torch.uint8)
        buf.local.fill_(7)
        second.barrier()
        res["second_heap_shares_init"] = rt.inits == 1 and rt.refs == 2 and int(buf.views[0].sum()) == 7 * 1024
        try:
            second.reserve(rt.size * 2)
            res["size_check"] = None
        except RuntimeFault as e:
            res["size_check"] = str(e)
        second.close()
        res["finalizes_after_first_close"] = rt.finalizes
        heap.close()
        res["finalizes_after_last_close"] = rt.finalizes
        ok = ok and res["second_heap_shares_init"] and bool(res["size_check"]) and "needs" in res["size_check"] \
            and res["finalizes_after_first_close"] == 0 and res["finalizes_after_last_close"] == 1
    else:
        heap.close()
        if refusal:
            ok = ok and bool(res["no_gpu_error"]) and "needs a CUDA device" in res["no_gpu_error"]
    dist.destroy_process_group()
    print(json.dumps(res, indent=1, default=str))
    res["ok"] = bool(ok)
    return res


def part_train_step(smoke: bool, out: str) -> dict:
    import copy

    import torch

    from moe_compile import moe_compile
    from moe_compile.models import TinyMoEConfig, TinyMoELM

    device = "cpu" if smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the tolerances assume IEEE fp32 GEMMs on both sides
    cfg = (TinyMoEConfig(d_model=32, n_heads=2, n_layers=1, num_experts=4, expert_hidden=32, max_seq_len=32)
           if smoke else TinyMoEConfig(n_layers=2))
    torch.manual_seed(0)
    model = TinyMoELM(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(3, cfg.vocab_size, (2, 8 if smoke else 32), generator=g).to(device)
    ref = copy.deepcopy(model)
    ref_loss = ref(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    t0 = time.perf_counter()
    cm = moe_compile(copy.deepcopy(model), None, codegen="triton")
    loss = cm(input_ids=batch, labels=batch).loss
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    grads = cm.full_grads()
    errs = {n: rel_err(grads[n].float(), (p.grad if p.grad is not None else torch.zeros_like(p)).float())
            for n, p in ref.named_parameters()}
    worst = max(errs, key=errs.get)
    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
    kernels = sorted({k["name"] for per in cm.kernels().values() for k in per})
    syncs = None
    if device == "cuda":  # a second step (compiled already; its gradients accumulate) under the sync debug mode
        _, syncs = cuda_syncs(lambda: cm(input_ids=batch, labels=batch).loss.backward())
        torch.cuda.synchronize()
    tol_loss, tol_grad = TOL[device]
    res = {"device": device, "codegen": cm.program.codegen, "config": {k: getattr(cfg, k) for k in
           ("d_model", "n_layers", "num_experts", "top_k", "expert_hidden")}, "tokens": batch.numel(),
           "loss": loss.item(), "loss_ref": ref_loss.item(), "loss_rel_err": loss_err,
           "grad_rel_err_max": errs[worst], "worst_param": worst, "params": len(errs),
           "tolerance": {"loss": tol_loss, "grad": tol_grad}, "kernels": kernels,
           "compile_and_step_s": round(step_s, 2), "second_step_host_syncs": syncs}
    print(json.dumps(res, indent=1))
    res["ok"] = (cm.program.codegen == "triton" and bool(kernels) and len(errs) == len(grads)
                 and loss_err <= tol_loss and errs[worst] <= tol_grad)
    cm.close()
    return res


def _junit(path: str) -> dict:
    import xml.etree.ElementTree as ET

    if not os.path.exists(path):
        return {"junit": None}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, per_test = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = next((c for c in case if c.tag == "skipped"), None)
        per_test[name] = {"s": float(case.get("time", 0)), "outcome": bad.tag if bad is not None else
                          "skipped" if skipped is not None else "passed"}
        if bad is not None:
            failed.append({"test": name, "message": (bad.get("message") or "")[:600],
                           "text": (bad.text or "")[-2500:]})
    return dict(counts, failed=failed, per_test=per_test)


def part_kernel_tests(smoke: bool, out: str) -> dict:
    junit = os.path.join(out, "kernel_tests_junit.xml")
    targets = SMOKE_KERNEL_TESTS if smoke else KERNEL_TESTS
    env = dict(os.environ, MOE_COMPILE_TEST_DEVICE="cpu" if smoke else "cuda",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    # a file that fails to import (e.g. torchao missing for test_mxfp8.py) must not cost the others
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}",
           "--continue-on-collection-errors", *targets]
    print(" ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env)
    res = {"command": cmd, "device": env["MOE_COMPILE_TEST_DEVICE"], "pytest_returncode": p.returncode, **_junit(junit)}
    # judged by the junit counts: pytest also exits 1 when tests/conftest.py finds /dev/shm segments
    # that other processes on the machine left (its session check), with every test passed
    res["ok"] = p.returncode in (0, 1) and bool(res.get("tests")) and res.get("failures") == res.get("errors") == 0
    return res


def part_kernel_bench(smoke: bool, out: str) -> dict:
    if smoke:
        raise Skip(SMOKE_SKIP["kernel_bench"])
    import contextlib
    import io

    sys.path.insert(0, BENCH)
    import gpu_kernels

    rows_path = os.path.join(out, "kernel_bench_rows.json")

    class Tee(io.StringIO):
        def write(self, s):
            sys.__stdout__.write(s)
            return super().write(s)

    buf = Tee()
    with contextlib.redirect_stdout(buf):
        rc = gpu_kernels.main(["--json", rows_path])
    rows = json.load(open(rows_path)) if os.path.exists(rows_path) else []
    return {"returncode": rc, "table": buf.getvalue(), "rows": rows,
            "mismatches": [r["kernel"] for r in rows if not r.get("ok", True)], "ok": rc == 0 and bool(rows)}


def part_dense_fusion(smoke: bool, out: str) -> dict:
    if smoke:
        raise Skip(SMOKE_SKIP["dense_fusion"])
    path = os.path.join(out, "one_rank_step.json")
    p = subprocess.run([sys.executable, os.path.join(BENCH, "one_rank_step.py"), "--device", "cuda", "--rounds", "5",
                        "--paths", "hf_eager,torch_compile,moe_none,moe_inductor", "--json", path], capture_output=True, text=True)
    sys.stdout.write(p.stdout[-4000:] + p.stderr[-4000:])
    res = json.load(open(path)) if os.path.exists(path) else {}
    keep = ("step_seconds", "compile_seconds", "ratios", "ratios_of_min", "moe_none_top_self_cpu")
    return {"returncode": p.returncode, **{k: res[k] for k in keep if k in res},
            "ok": p.returncode == 0 and "moe_inductor/hf_eager" in res.get("ratios", {})}


PART_FNS = {"env": part_env, "nvshmem": part_nvshmem, "train_step": part_train_step,
            "kernel_tests": part_kernel_tests, "kernel_bench": part_kernel_bench, "dense_fusion": part_dense_fusion}


def run_part(name: str, smoke: bool, out: str) -> int:
    """Child process: run one part, write DIR/<name>.json."""
    t0 = time.perf_counter()
    rec: dict = {"part": name, "smoke": smoke}
    try:
        result = PART_FNS[name](smoke, out)
        rec.update(status="ok" if result.pop("ok", False) else "failed", result=result)
    except Skip as e:
        rec.update(status="skipped", reason=str(e))
    except BaseException as e:  # noqa: BLE001 - recorded in the part's JSON
        rec.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-6000:])
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(os.path.join(out, f"{name}.json"), rec)
    print(f"[{name}] {rec['status']} in {rec['seconds']} s", flush=True)
    return 0


# -- driver (parent process) --------------------------------------------------------------------------


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def drive(name: str, smoke: bool, out: str, timeout: float) -> dict:
    log = os.path.join(out, f"{name}.log")
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        os.unlink(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--out", out] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and everything it started (pytest, ranks)
            rc = proc.wait()
            timed_out = True
    seconds = round(time.perf_counter() - t0, 2)
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        rec = {"part": name, "smoke": smoke, "status": "timeout" if timed_out else "error",
               "error": f"killed after {timeout:.0f} s" if timed_out else f"the part exited {rc} without its JSON"}
    rec.update(wall_seconds=seconds, timeout_s=round(timeout), returncode=rc, log=log, log_tail=_tail(log))
    write_json(path, rec)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for <part>.json, <part>.log and summary.json")
    ap.add_argument("--smoke", action="store_true", help="CPU: the parts' CPU fallbacks at tiny sizes")
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for all parts together (default 460)")
    ap.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts (e.g. a rerun)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # child process: one part
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.part:
        return run_part(args.part, args.smoke, out)
    import torch

    t_start = time.time()
    summary = {"smoke": args.smoke, "gpu": torch.cuda.is_available(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "budget_s": args.budget, "parts": {}}
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no GPU here (torch.cuda.is_available() is False); the GPU check needs one. Nothing was "
              "run. (--smoke runs the CPU-checkable parts.)")
        summary.update(ok=True, note="no GPU: nothing was run")
        write_json(os.path.join(out, "summary.json"), summary)
        return 0
    caps = SMOKE_TIMEOUT_S if args.smoke else TIMEOUT_S
    deadline = time.monotonic() + args.budget
    for name in args.only or PARTS:
        left = deadline - time.monotonic()
        if left < 10 or (args.smoke and name in SMOKE_SKIP):
            reason = f"budget of {args.budget:.0f} s spent" if left < 10 else SMOKE_SKIP[name]
            rec = {"part": name, "smoke": args.smoke, "status": "skipped", "reason": reason}
            write_json(os.path.join(out, f"{name}.json"), rec)
        else:
            print(f"[{name}] running (timeout {min(caps[name], left):.0f} s) ...", flush=True)
            rec = drive(name, args.smoke, out, min(caps[name], left))
        summary["parts"][name] = {"status": rec["status"], "seconds": rec.get("wall_seconds")}
        print(f"[{name}] {rec['status']} ({rec.get('wall_seconds', 0)} s)"
              + (f": {rec.get('error') or rec.get('reason')}" if rec["status"] not in ("ok", "failed") else ""),
              flush=True)
    summary["seconds"] = round(time.time() - t_start, 1)
    # skipped passes only in a smoke run (kernel_bench there) or for a measurement-only part (dense_fusion,
    # last, takes what the budget leaves); on a GPU a verification part the budget cut is a failure
    summary["ok"] = all(p["status"] == "ok" or (p["status"] == "skipped" and (args.smoke or name in MEASURE_ONLY))
                        for name, p in summary["parts"].items())
    write_json(os.path.join(out, "summary.json"), summary)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
