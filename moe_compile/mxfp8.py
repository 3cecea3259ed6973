"""MXFP8 (OCP Microscaling): FP8 E4M3 elements with one E8M0 scale per 32 contiguous elements along
the last dimension.

    to_mxfp8(x, mode="rceil") -> (qdata: float8_e4m3fn [..., K], scales: float8_e8m0fnu [..., K/32])
    from_mxfp8(qdata, scales, dtype) -> x̂ = qdata · 2^(scale − 127)

Scale of a block with amax = max|x| over its 32 elements (an E8M0 exponent e, scale 2^(e−127)):

    rceil (default):  e = ceil(log2(amax / 448)) + 127      (the smallest scale with no saturation)
    floor (OCP):      e = floor(log2(amax)) − 8 + 127        (amax's exponent minus E4M3's max, 8)

Exponents come from the fp32 exponent bits, exactly (casting to float8_e8m0fnu would round to
nearest). Conventions, shared with torchao 0.18's ``to_mx``:

* elements are x / scale, saturated to ±448, cast with round-to-nearest-even;
* zero or tiny blocks: rceil clamps e at 0 and then does not scale the elements (they flush to E4M3
  zero/subnormals), floor clamps the unbiased exponent at −127; dequantised, such a block is ~0;
* NaN anywhere in a block: e = 255 (NaN scale) and the block dequantises to NaN;
* ±Inf in a block: rceil e = 254 (elements become ±448 / 0), floor e = the largest exponent;
* the last dimension must be a multiple of 32 (``check_block_dim`` names the tensor when not).

Payloads travel packed: ``pack_mx`` joins qdata and scales row by row into one uint8 tensor
[..., K + K/32] — one qdata–scale payload, allocated, moved and released together.
"""

from __future__ import annotations

import torch

from .errors import MoECompileError

BLOCK = 32
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8
E8M0_BIAS = 127
MODES = ("rceil", "floor")


def check_block_dim(k: int, what: str) -> None:
    if k % BLOCK:
        raise MoECompileError(f"MXFP8: {what} has size {k} along the quantised dimension, not a multiple of {BLOCK}")


def _exponent_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased fp32 exponent, mantissa bits) of a non-negative fp32 tensor."""
    bits = x.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def block_exponents(amax: torch.Tensor, mode: str = "rceil") -> torch.Tensor:
    """Biased E8M0 exponents (uint8) for block maxima ``amax`` (fp32, ≥ 0 or NaN)."""
    amax = amax.float()
    nan, inf = torch.isnan(amax), torch.isinf(amax)
    if mode == "rceil":
        descale = amax / E4M3_MAX
        exp, mant = _exponent_bits(descale)
        # ceil(log2(descale)) = exp when descale is an exact power of two, else exp + 1. A subnormal
        # descale (exp field −127) is m·2^−149: its ceil-log2 exceeds −127 only when m > 2^22.
        e = torch.where(mant > 0, exp + 1, exp)
        e = torch.where(exp == -127, torch.where(mant > 2**22, -126, -127), e)
        e = e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        e = torch.where(inf, torch.full_like(e, 254), e)
    elif mode == "floor":
        exp, _ = _exponent_bits(amax)
        e = (exp - E4M3_MAX_POW2).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    else:
        raise ValueError(f"MXFP8 scale mode {mode!r}; supported: {MODES}")
    return torch.where(nan, torch.full_like(e, 255), e).to(torch.uint8)


def _element_scale(e: torch.Tensor, mode: str) -> torch.Tensor:
    """The fp32 divisor (floor) or multiplier (rceil) applied to elements before the E4M3 cast."""
    ei = e.to(torch.int32)
    if mode == "rceil":
        rcp = torch.exp2((E8M0_BIAS - ei).float())
        rcp = torch.where(ei == 254, torch.full_like(rcp, 2.0**-127), rcp)
        rcp = torch.where(ei == 0, torch.ones_like(rcp), rcp)
        return torch.where(ei == 255, torch.full_like(rcp, float("nan")), rcp)
    scale = (ei << 23).view(torch.float32)  # 2^(e − 127); e = 255 gives +Inf (elements → 0 or NaN)
    return scale.clamp(min=2.0**-126)


def to_mxfp8(x: torch.Tensor, *, mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (fp32/bf16/fp16) along its last dimension. Returns (qdata, scales)."""
    k = x.shape[-1]
    check_block_dim(k, f"tensor of shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    e = block_exponents(amax, mode)
    s = _element_scale(e, mode)
    data = blocks * s if mode == "rceil" else blocks / s
    q = data.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(x.shape)
    return q, e.squeeze(-1).view(torch.float8_e8m0fnu)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(e − 127) of E8M0 scales; e = 255 is NaN."""
    e = scales.view(torch.uint8).to(torch.int32)
    v = torch.exp2((e - E8M0_BIAS).float())
    return torch.where(e == 255, torch.full_like(v, float("nan")), v)


def from_mxfp8(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = qdata.shape[-1]
    blocks = qdata.float().reshape(*qdata.shape[:-1], k // BLOCK, BLOCK)
    return (blocks * scale_values(scales).unsqueeze(-1)).reshape(qdata.shape).to(dtype)


# -- packed qdata–scale payloads -----------------------------------------------------------------


def packed_width(k: int) -> int:
    return k + k // BLOCK


def pack_mx(qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 tensor [..., K + K/32]: each row's qdata bytes, then its scale bytes."""
    return torch.cat([qdata.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack_mx(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (qdata [..., K], scales [..., K/32]) of a packed payload."""
    return packed[..., :k].view(torch.float8_e4m3fn), packed[..., k:].view(torch.float8_e8m0fnu)


def quantize_packed(x: torch.Tensor, mode: str = "rceil") -> torch.Tensor:
    return pack_mx(*to_mxfp8(x, mode=mode))


def dequantize_packed(packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q, s = unpack_mx(packed, k)
    return from_mxfp8(q.contiguous(), s.contiguous(), dtype)
