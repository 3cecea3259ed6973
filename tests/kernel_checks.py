"""Kernel-test helpers: which device the kernel tests run on, and how a kernel is compared with a torch
reference whose summation order is not fixed on CUDA.

Device (``kernel_test_device``): ``MOE_COMPILE_TEST_DEVICE=cpu|cuda`` when set (cuda without a GPU is
an error, not a silent fallback), else cuda when available (natively compiled kernels), else cpu (the
Triton interpreter). ``benchmarks/gpu_check.py`` sets ``MOE_COMPILE_TEST_DEVICE=cuda``.

``assert_close_kernel(actual, ref)`` — for references that sum with ``index_add_`` (moe::unpermute,
moe::permute_backward), which the deterministic unpermute kernel reproduces on the CPU:

* CPU / interpreter: bitwise equal. On the CPU ``index_add_`` adds in increasing row order, in fp32
  for bf16, rounding once — the kernel's order and rounding.
* CUDA: ``index_add_`` is an atomicAdd per element: its order varies from run to run (and with bf16
  outputs every addition rounds to bf16), so bitwise equality is not defined. The kernel must then
  be within ``|a − r| ≤ tol · max|r|`` (the tensor's own scale, as ``rel_err``):

  - fp32: tol = 1e-5. Reordering K additions of terms ≤ m moves a sum by ≤ (K−1)·2⁻²⁴·K·m
    (≈ 7e-7·m for K = 4); 1e-5 leaves a 10× margin and matches the GEMM tests' fp32 tolerance.
  - bf16 / fp16: tol = 2⁻⁵ ≈ 0.031. The atomic reference rounds each of its K partial sums (≤ K·m)
    to bf16 (2⁻⁹ relative): ≤ K·2⁻⁹·K·m = 2⁻⁵·m for K = 4 — the worst case, a few bf16 ulps.
"""

from __future__ import annotations

import os

import torch

from moe_compile.codegen.triton_mode import default_device_type

ENV = "MOE_COMPILE_TEST_DEVICE"
CUDA_TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-5}


def kernel_test_device() -> str:
    want = os.environ.get(ENV, "").strip().lower()
    if not want:
        return default_device_type()
    if want not in ("cpu", "cuda"):
        raise RuntimeError(f"{ENV}={want!r}: expected 'cpu' or 'cuda'")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{ENV}=cuda, but torch.cuda.is_available() is False in this process")
    return want


def kernel_tolerance(t: torch.Tensor) -> float:
    """0.0 (bitwise) off CUDA; the CUDA tolerance of the tensor's dtype otherwise (module docstring)."""
    return CUDA_TOL.get(t.dtype, 0.0) if t.is_cuda else 0.0


def assert_close_kernel(actual: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert actual.shape == ref.shape and actual.dtype == ref.dtype, (what, actual.shape, actual.dtype, ref.shape,
                                                                     ref.dtype)
    tol = kernel_tolerance(ref)
    if tol == 0.0:
        assert torch.equal(actual, ref), f"{what}: not bitwise equal to the reference"
        return
    a, r = actual.double(), ref.double()
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (a - r).abs().max().item() if r.numel() else 0.0
    assert err <= tol * (scale or 1.0), f"{what}: max |a − r| = {err:.3g} > {tol:.3g} · max|r| ({scale:.3g}) on CUDA"
