"""Each generated Triton kernel vs its torch reference — under the Triton interpreter on a machine
without a GPU (natively on one).

Shapes cover empty experts, row counts that are not a multiple of the tile (64 under the
interpreter), one expert holding every row, several route-map blocks, and reduction dimensions (K)
that are not a multiple of the block. Tolerances:

* index kernels (route map, inverse order, destination rows, permute gather): exact;
* unpermute / permute_backward: bitwise equal to moe::unpermute / moe::permute_backward (same
  summation order and per-addition rounding), fp32 and bf16, on the CPU; on CUDA the references'
  ``index_add_`` is atomic (no fixed order): within 1e-5 (fp32) / 2^-5 (bf16) of the tensor's scale
  (``kernel_checks.assert_close_kernel``, which derives the numbers); the kernel itself stays
  bitwise deterministic run to run on both; unpermute_backward's grad weights (a d-long dot
  product, summed in another order): rel_err ≤ 1e-6 fp32;
* grouped GEMMs and fused forms, fp32: rel_err ≤ 1e-5 (of the tensor's max magnitude);
  bf16 (fp32 accumulation, bf16 output): rel_err ≤ 1e-2 against torch's bf16 grouped mm;
* activations over the valid prefix, fp32: rel_err ≤ 1e-5; rows past the prefix stay unwritten;
* MXFP8 address arithmetic: int64 offsets where G·N·(K + K/32) ≥ 2^31 (exact).

Device: ``MOE_COMPILE_TEST_DEVICE`` (cpu | cuda), else cuda when available, else the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from moe_compile.codegen.triton_mode import kernel_module, use_triton

from .common import rel_err
from .kernel_checks import assert_close_kernel, kernel_test_device

DEVICE = kernel_test_device()


@pytest.fixture(scope="module")
def K():
    """Kernel modules, loaded after the Triton mode is fixed (interpreter on CPU)."""
    use_triton(DEVICE)
    return lambda family: kernel_module(family)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _idx(t: int, k: int, n: int, seed: int, only: int | None = None, skip: int | None = None) -> torch.Tensor:
    g = _gen(seed)
    idx = torch.randint(0, n, (t, k), generator=g)
    if only is not None:
        idx.fill_(only)
    if skip is not None:
        idx[idx == skip] = (skip + 1) % n
    return idx.to(DEVICE)


ROUTES = [  # (T, K, N, only one expert, skipped expert)
    pytest.param(37, 3, 5, None, 2, id="empty-expert"),
    pytest.param(300, 2, 64, None, None, id="blocks-N64"),
    pytest.param(50, 2, 4, 1, None, id="one-expert"),
]


@pytest.mark.parametrize("t,k,n,only,skip", ROUTES)
def test_route_map_order_counts_offsets(K, t, k, n, only, skip):
    rm = K("route_map")
    idx = _idx(t, k, n, seed=t, only=only, skip=skip)
    order, counts, offsets = rm.expert_order(idx, n)
    r_order, r_counts, r_offsets = rm.expert_order_reference(idx, n)
    assert torch.equal(order, r_order) and torch.equal(counts, r_counts) and torch.equal(offsets, r_offsets)
    if skip is not None:
        assert counts[skip] == 0
    assert torch.equal(rm.invert_order(order), rm.invert_order_reference(order))


@pytest.mark.parametrize("ep,nl,cap", [(2, 3, 9), (3, 2, 1000), (4, 1, 5)])
def test_dst_rows_match_the_transport_route_map(K, ep, nl, cap):
    from moe_compile.runtime import keep_counts

    rm = K("route_map")
    req = torch.randint(0, 6, (ep, ep, nl), generator=_gen(ep))
    req[0, :, 0] = 0  # an empty (src, dst, expert) segment
    layout = torch.stack([req, keep_counts(req, cap)]).to(DEVICE)
    dropped = 0
    for me in range(ep):
        rows = int(req[me].sum())
        dst, row = rm.dst_rows(layout, me, rows)
        r_dst, r_row = rm.dst_rows_reference(layout, me, rows)
        assert torch.equal(dst, r_dst) and torch.equal(row, r_row), me
        dropped += int((row < 0).sum())
    assert (dropped > 0) == (cap < 100)  # the capacity rule's tail drop is exercised where intended


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_gathers_rows_in_expert_order(K, dtype):
    idx = _idx(45, 2, 6, seed=1, skip=3)
    x = torch.randn(45, 72, generator=_gen(2)).to(DEVICE, dtype)
    got = K("permute").permute(x, idx, 6)
    ref = K("permute").permute_reference(x, idx, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_unpermute_combine_is_moe_unpermute(K, dtype, wdtype):
    um, rm = K("unpermute"), K("route_map")
    t, k, n, d = 41, 4, 7, 80  # d not a multiple of the 64-column tile
    idx = _idx(t, k, n, seed=5)
    order = rm.expert_order(idx, n)[0]
    back = torch.randn(t * k, d, generator=_gen(6)).to(DEVICE, dtype)
    w = torch.rand(t, k, generator=_gen(7)).to(DEVICE, wdtype)
    y = um.unpermute(back, order, w)
    assert_close_kernel(y, um.unpermute_reference(back, order, w), "unpermute")  # bitwise off CUDA
    assert torch.equal(y, um.unpermute(back, order, w))  # deterministic: no atomics (also on CUDA)
    assert_close_kernel(um.permute_backward(back, order, t, k), um.permute_backward_reference(back, order, t, k),
                        "permute_backward")
    gy = torch.randn(t, d, generator=_gen(8)).to(DEVICE, dtype)
    g_back, g_w = um.unpermute_backward(gy, back, order, w)
    r_back, r_w = um.unpermute_backward_reference(gy, back, order, w)
    assert torch.equal(g_back, r_back)
    assert rel_err(g_w.float(), r_w.float()) <= (1e-6 if wdtype == torch.float32 else 1e-2)


COUNTS = [
    pytest.param([0, 70, 0, 61], id="empty-experts"),
    pytest.param([131, 0, 0, 0], id="one-expert"),
    pytest.param([0, 0, 0, 0], id="no-rows"),
]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_over_expert_offsets(K, counts, dtype):
    gg = K("grouped_gemm")
    cap, k, n = 200, 40, 96  # K = 40 and N = 96: not multiples of the 64 blocks; cap past the prefix
    c = torch.tensor(counts, device=DEVICE)
    a = torch.randn(cap, k, generator=_gen(1)).to(DEVICE, dtype)
    b = torch.randn(len(counts), n, k, generator=_gen(2)).to(DEVICE, dtype).transpose(1, 2)  # a weight view
    v = sum(counts)
    full = gg.grouped_mm(a, b, c)
    assert full.shape == (cap, n) and full.dtype == dtype  # no rows: a capacity-shaped output all the same
    if v == 0:
        return  # rows past the valid prefix are unwritten by contract: nothing more to compare
    got = full[:v]
    ref = gg.grouped_mm_reference(a, b, c)
    # bf16 under the interpreter exercises the upcast of tl.dot operands (interpreter bug: bf16 dot is wrong)
    assert rel_err(got.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu", False)])
def test_grouped_mm_fused_activation_forms(K, activation, gated):
    gg, sw = K("grouped_gemm"), K("swiglu")
    counts = torch.tensor([0, 67, 5], device=DEVICE)
    v, cap, d, h = 72, 100, 48, 40
    f = 2 * h if gated else h
    pre = torch.randn(cap, f, generator=_gen(3), device="cpu").to(DEVICE)
    w_out = torch.randn(3, d, h, generator=_gen(4)).to(DEVICE)  # [L, d, h]
    prologue = "gated" if gated else "act"
    # forward: activation fused into the down projection's A-load
    got = gg.grouped_mm(pre, w_out.transpose(1, 2), counts, prologue=prologue, activation=activation)[:v]
    a = sw.swiglu_reference(pre, counts, activation, gated)
    assert rel_err(got, gg.grouped_mm_reference(a, w_out.transpose(1, 2), counts)) <= 1e-5
    # backward: grad a = grad out @ w_out, with the activation's backward fused into the epilogue
    go = torch.randn(cap, d, generator=_gen(5)).to(DEVICE)
    epilogue = "gated_backward" if gated else "act_backward"
    g_pre = gg.grouped_mm(go, w_out, counts, epilogue=epilogue, activation=activation, e=pre)[:v]
    ga = gg.grouped_mm_reference(go, w_out, counts)
    assert rel_err(g_pre, sw.swiglu_backward_reference(ga, pre, counts, activation, gated)) <= 1e-5
    # weight gradient of the down projection, activation recomputed in the wgrad prologue
    g_w = gg.grouped_mm_wgrad(go, pre, counts, prologue=prologue, activation=activation)
    assert rel_err(g_w, gg.grouped_mm_wgrad_reference(go, a_full(a, cap), counts)) <= 1e-5
    assert torch.count_nonzero(g_w[0]) == 0  # the empty expert's gradient is zero


def a_full(a: torch.Tensor, cap: int) -> torch.Tensor:
    return torch.cat([a, a.new_zeros(cap - a.shape[0], a.shape[1])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_wgrad(K, dtype):
    gg = K("grouped_gemm")
    counts = torch.tensor([3, 0, 90, 1], device=DEVICE)  # rows per expert: the loop's K dimension
    x = torch.randn(120, 40, generator=_gen(6)).to(DEVICE, dtype)
    y = torch.randn(120, 72, generator=_gen(7)).to(DEVICE, dtype)
    got = gg.grouped_mm_wgrad(x, y, counts)
    assert got.shape == (4, 40, 72)
    assert torch.count_nonzero(got[1]) == 0
    ref = gg.grouped_mm_wgrad_reference(x, y, counts)
    assert rel_err(got.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu_tanh", True), ("gelu", False), ("relu", False)])
def test_activation_over_the_valid_prefix_only(K, activation, gated):
    sw = K("swiglu")
    counts = torch.tensor([20, 0, 50], device=DEVICE)  # valid = 70 of 130 capacity rows
    cap, h = 130, 72
    pre = torch.randn(cap, 2 * h if gated else h, generator=_gen(8)).to(DEVICE)
    out = torch.full((cap, h), float("nan"), device=DEVICE)
    sw.swiglu(pre, counts, activation, gated, out=out)
    assert rel_err(out[:70], sw.swiglu_reference(pre, counts, activation, gated)) <= 1e-5
    assert out[70:].isnan().all()  # capacity rows past the valid prefix are never written
    ga = torch.randn(cap, h, generator=_gen(9)).to(DEVICE)
    g_pre = torch.full_like(pre, float("nan"))
    sw.swiglu_backward(ga, pre, counts, activation, gated, out=g_pre)
    assert rel_err(g_pre[:70], sw.swiglu_backward_reference(ga, pre, counts, activation, gated)) <= 1e-5
    assert g_pre[70:].isnan().all()


def test_triton_ffn_ops_match_the_moe_ops(K):
    """The moe_triton:: ops lowering swaps in: same results (valid prefix) and same fake shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_compile.codegen.lowering_table import triton_lowerings

    table = triton_lowerings()
    counts = torch.tensor([0, 33, 31], device=DEVICE)
    v, cap, d, h = 64, 96, 40, 24
    recv = torch.randn(cap, d, generator=_gen(10)).to(DEVICE)
    w_in = torch.randn(3, 2 * h, d, generator=_gen(11)).to(DEVICE)
    w_out = torch.randn(3, d, h, generator=_gen(12)).to(DEVICE)
    args = (recv, counts, w_in, w_out, "silu", True, "blk")
    out, pre = table["grouped_ffn"].target(*args)
    r_out, r_pre = torch.ops.moe.grouped_ffn(*args)
    assert rel_err(out[:v], r_out[:v]) <= 1e-5 and rel_err(pre[:v], r_pre[:v]) <= 1e-5
    go = torch.randn(cap, d, generator=_gen(13)).to(DEVICE)
    bargs = (go, recv, r_pre, counts, w_in, w_out, "silu", True, "blk")
    got = table["grouped_ffn_backward"].target(*bargs)
    ref = torch.ops.moe.grouped_ffn_backward(*bargs)
    assert rel_err(got[0][:v], ref[0][:v]) <= 1e-5
    assert rel_err(got[1], ref[1]) <= 1e-5 and rel_err(got[2], ref[2]) <= 1e-5
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in bargs]
        shapes = [tuple(t.shape) for t in table["grouped_ffn_backward"].target(*fake)]
    assert shapes == [tuple(t.shape) for t in ref]


def test_kernel_cache_is_keyed_by_specialisation(K):
    from moe_compile.codegen.kernel_cache import CACHE

    gg = K("grouped_gemm")
    a = torch.randn(64, 32, device=DEVICE)
    b3 = torch.randn(3, 32, 16, device=DEVICE)
    b4 = torch.randn(4, 32, 16, device=DEVICE)
    c3 = torch.tensor([10, 0, 20], device=DEVICE)
    c3b = torch.tensor([1, 29, 0], device=DEVICE)  # other counts: same specialisation (counts are data)
    p3, p3b = gg.plan_grouped_mm(a, b3, c3), gg.plan_grouped_mm(a, b3, c3b)
    p4 = gg.plan_grouped_mm(a, b4, torch.tensor([1, 2, 3, 4], device=DEVICE))
    assert p3.spec == p3b.spec and p3.spec != p4.spec  # num_local_experts is part of it
    assert dict(p3.spec.static)["L"] == 3
    gg.grouped_mm(a, b3, c3)
    gg.grouped_mm(a, b3, c3b)
    assert CACHE[p3.spec].launches >= 2
    assert p3.grid(p3.config()) == (1 + 3, 1)  # capacity tiles + one per expert, one column tile


def test_mxfp8_offsets_are_int64_past_2_31(K):
    """DeepSeek-V3's packed w_in with 71 local experts: [G=71, N=2·2048, K + K/32 = 7168 + 224] is
    2.15e9 bytes, so the last expert's offsets pass 2^31. The kernels' offset helpers (run in a probe
    kernel: such a buffer cannot be allocated here) give them exactly; the former int32 expression
    wraps, under the interpreter as on the hardware."""
    from . import offset_probe

    K("mxfp8")
    n, kp = 2 * 2048, 7168 + 7168 // 32
    g, stride_g, stride_r = 70, n * kp, kp
    rows = torch.tensor([0, 1, n - 2, n - 1], dtype=torch.int32, device=DEVICE)
    cols = torch.tensor([0, 7168, kp - 2, kp - 1], dtype=torch.int32, device=DEVICE)
    exact = torch.tensor([[g * stride_g + r * stride_r + c for c in cols.tolist()] for r in rows.tolist()],
                         dtype=torch.int64)
    assert exact.max() >= 2**31
    out = torch.empty(4, 4, dtype=torch.int64, device=DEVICE)
    offset_probe.packed_offsets_kernel[(1,)](out, rows, cols, g, stride_g, stride_r, R=4, C=4)
    assert torch.equal(out.cpu(), exact)
    offset_probe.naive_offsets_kernel[(1,)](out, rows, cols, g, stride_g, stride_r, R=4, C=4)
    wrapped = (exact + 2**31) % 2**32 - 2**31  # two's-complement int32
    assert torch.equal(out.cpu(), wrapped) and not torch.equal(wrapped, exact)
