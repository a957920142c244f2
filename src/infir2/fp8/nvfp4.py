"""NVFP4 quantization: E2M1 elements, E4M3 block scales, one fp32 scale per tensor (the reference).

NVFP4 is TransformerEngine's 4-bit training format (NVIDIA, "Pretraining LLMs with NVFP4", 2025).
A 2-D tensor ``x [M, K]`` is cut into blocks of 16 elements along the GEMM's reduction dimension
(``(1, 16)``; ``(16, 1)`` for an operand the GEMM reads transposed) or, for weights, 16x16 blocks
(``(16, 16)``: the same block for ``W`` and ``W.T``, so fprop and dgrad share one quantized weight).
Two levels of scale::

    tensor_scale_inv = amax(x) / (448 * 6)          fp32, one per tensor (1 if amax is 0)
    block_scale_inv  = e4m3(amax(block) / 6 / tensor_scale_inv)   clamped to [2**-6, 448]
    data             = e2m1(x * ((1 / tensor_scale_inv) / block_scale_inv))   saturated to +-6
    x'               = e2m1_value(data) * block_scale_inv * tensor_scale_inv

448 is the E4M3 maximum and 6 the E2M1 maximum (``infir2.fp8.formats``): the per-tensor scale lets
the largest block scale reach 448, and the E4M3 block scale keeps 3 mantissa bits of each block's
range (MXFP4's power-of-two E8M0 scale keeps none). The arithmetic is torchao's
``nvfp4_quantize`` (``torchao.prototype.mx_formats.nvfp4_tensor``) operation for operation: every
fp32 division and reciprocal in the same order, so the codes and block scales are equal bit for bit
(the tests compare them). An all-zero tensor gets ``tensor_scale_inv = 1`` (as TransformerEngine
does; torchao would divide by zero). A tensor holding a NaN or an infinity gets NaN block scales
throughout: E2M1 has no NaN, and one non-finite value poisons the per-tensor amax.

Rounding (``rounding``): ``"nearest"`` is round-to-nearest-even, ties to the even code; ``"stochastic"``
rounds up with probability equal to the distance from the lower neighbour over the spacing, which is
unbiased (``E[q] = x`` inside the range). The noise is uniform in [0, 1), drawn from ``generator``;
without one, from the generator of the innermost :func:`noise_generator` context, else from torch's
generator of the tensor's device. Training and RL's updates open one context per micro-batch
(``infir2.harness.step.rounding_noise``), with a generator seeded by :func:`noise_seed` from (run seed,
step, the micro-batch's place in the step): the draws depend on nothing else, so a run resumed from a
checkpoint, and a run whose micro-batches are spread over data-parallel processes, draw the same noise
as one uninterrupted process.

The random Hadamard transform (``hadamard_transform``): before quantizing the wgrad operands
``dY`` and ``X`` (blocks ``(16, 1)``, along tokens), TransformerEngine multiplies every 16 tokens by
``H = Hadamard16 @ diag(s) / 4`` with a fixed random sign vector ``s``. ``H`` is orthogonal, so
``(H dY)^T (H X) = dY^T X``: the wgrad product is unchanged, but an outlier is spread over 16
elements before the 4-bit cast. Token counts that are not a multiple of 16 are zero-padded (both
operands the same way, which keeps the product).

Storage: ``data`` holds one unpacked code per byte (``uint8``, bit 3 the sign, bits 0-2 the index into
``E2M1.values``), the layout torchao's ``f32_to_f4_unpacked`` returns; :func:`pack_nibbles` packs two
per byte (element ``2i`` in the low nibble), the layout of torchao's ``pack_uint4`` and of
``torch.float4_e2m1fn_x2``. Unpacked codes transpose and slice like any tensor; the bytes a packed
copy would take are what memory accounting counts (``nbytes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F

from .formats import E2M1, FORMATS, HADAMARD_SEED, NVFP4_BLOCK, Fp4Format
from .quantize import Block, expand_blocks

__all__ = [
    "ROUNDINGS",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "hadamard_matrix",
    "hadamard_transform",
    "noise_generator",
    "noise_seed",
    "pack_nibbles",
    "quantize_nvfp4",
    "tensor_scale_inv",
    "unpack_nibbles",
]

ROUNDINGS = ("nearest", "stochastic")
_SCALE = FORMATS["e4m3"]  # the format of the block scales
_SCALE_MIN = float(torch.finfo(_SCALE.dtype).smallest_normal)  # 2**-6: the smallest block scale


_NOISE: list[torch.Generator] = []  # the generators of the open noise_generator contexts, innermost last
_FNV_PRIME, _FNV_OFFSET, _U64 = 0x100000001B3, 0xCBF29CE484222325, 2**64


def noise_seed(*parts: int) -> int:
    """A 64-bit seed mixed from integers (FNV-1a over their 64-bit values): the same parts, the same seed,
    on every process and every Python (``hash`` would do for ints, but says nothing about its mixing)."""
    h = _FNV_OFFSET
    for p in parts:
        h = ((h ^ (p % _U64)) * _FNV_PRIME) % _U64
    return h


@contextmanager
def noise_generator(generator: torch.Generator) -> Iterator[torch.Generator]:
    """Stochastic rounding inside the block draws from ``generator`` (module doc)."""
    _NOISE.append(generator)
    try:
        yield generator
    finally:
        _NOISE.pop()


@cache
def _values(fmt: Fp4Format, device: torch.device) -> torch.Tensor:
    return torch.tensor(fmt.values, dtype=torch.float32, device=device)


def e2m1_encode(y: torch.Tensor, noise: torch.Tensor | None = None, fmt: Fp4Format = E2M1) -> torch.Tensor:
    """fp32 ``y`` (already scaled) -> E2M1 codes (``uint8``), saturating at +-6.

    ``noise`` None: round to nearest, ties to even. ``noise`` (uniform in [0, 1), ``y``'s shape):
    stochastic rounding, ``floor(|y| / spacing + noise) * spacing``. The sign of ``y`` is kept (``-0.1``
    becomes negative zero, code 8), as torchao does. NaN becomes code 0 (the block scale carries it).
    """
    mag = torch.nan_to_num(y.float().abs(), nan=0.0).clamp_(max=fmt.max)
    _, exponent = torch.frexp(mag)  # mag = m * 2**exponent, m in [0.5, 1): floor(log2 mag) = exponent - 1
    exponent = (exponent - 1).clamp_(fmt.emin, fmt.emax)  # subnormals share the spacing of 2**emin
    spacing = torch.ldexp(torch.ones_like(mag), exponent - fmt.mbits)
    steps = mag / spacing  # exact: the spacing is a power of two
    steps = torch.round(steps) if noise is None else torch.floor(steps + noise)  # round(): ties to even
    q = (steps * spacing).clamp_(max=fmt.max)  # a value of the grid: searchsorted finds it exactly
    codes = torch.searchsorted(_values(fmt, mag.device), q.contiguous()).to(torch.uint8)
    return codes | (torch.signbit(y).to(torch.uint8) * fmt.sign_bit)


def e2m1_decode(codes: torch.Tensor, fmt: Fp4Format = E2M1) -> torch.Tensor:
    """E2M1 codes (``uint8``) -> their fp32 values."""
    mag = _values(fmt, codes.device)[(codes & (fmt.sign_bit - 1)).long()]
    return torch.where((codes & fmt.sign_bit) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` codes -> ``[M, K/2]`` bytes, element ``2i`` in the low nibble (torchao's ``pack_uint4``)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def tensor_scale_inv(amax: torch.Tensor, fmt: Fp4Format = E2M1) -> torch.Tensor:
    """The per-tensor fp32 ``scale_inv``: ``amax / (448 * 6)``; 1 where ``amax`` is 0."""
    amax = amax.float()
    out = amax / torch.full_like(amax, _SCALE.max * fmt.max)  # a true fp32 division, as torchao's
    return torch.where(amax == 0, 1.0, out)


@cache
def hadamard_matrix(n: int = NVFP4_BLOCK, seed: int = HADAMARD_SEED) -> torch.Tensor:
    """``H = Hadamard(n) @ diag(s) / sqrt(n)`` in fp32, ``s`` a fixed sign vector drawn from ``seed``.

    Sylvester's construction (``n`` a power of two); ``H @ H.T = I`` (orthogonal). Cached on the CPU.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (h * signs.double() / n**0.5).float()


def hadamard_transform(x: torch.Tensor, n: int = NVFP4_BLOCK, seed: int = HADAMARD_SEED) -> torch.Tensor:
    """``x [T, K]`` with every group of ``n`` rows multiplied by :func:`hadamard_matrix`: fp32 (fp64 for
    an fp64 ``x``; the entries of ``H`` are +-1/sqrt(n), exact in either).

    Rows are zero-padded to a multiple of ``n`` (the result has ``ceil(T / n) * n`` rows).
    """
    t, k = x.shape
    x = F.pad(x if x.dtype == torch.float64 else x.float(), (0, 0, 0, -t % n))
    h = hadamard_matrix(n, seed).to(x.device, x.dtype)
    return torch.einsum("ij,gjk->gik", h, x.reshape(-1, n, k)).reshape(-1, k)  # [n,n] @ [G,n,K] -> [G,n,K]


def _orient(block: Block) -> tuple[bool, Block]:
    """(transpose?, the block in row orientation): ``(16, 1)`` is ``(1, 16)`` of the transpose."""
    block = (int(block[0]), int(block[1]))
    allowed = {(1, NVFP4_BLOCK), (NVFP4_BLOCK, 1), (NVFP4_BLOCK, NVFP4_BLOCK)}
    if block not in allowed:
        raise ValueError(f"NVFP4 blocks are {sorted(allowed)}, got {block}")
    return (block == (NVFP4_BLOCK, 1)), (block[1], block[0]) if block == (NVFP4_BLOCK, 1) else block


def quantize_nvfp4(
    x: torch.Tensor,
    block: Block = (1, NVFP4_BLOCK),
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    fmt: Fp4Format = E2M1,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]``: ``(data [M, K] uint8 codes, block_scale_inv e4m3, tensor_scale_inv fp32 [])``.

    ``block_scale_inv`` is ``[ceil(M/bm), ceil(K/bk)]``; partial edge blocks are zero-padded. The
    arithmetic is the module doc's; ``rounding`` and ``generator`` as described there.

    ``four_over_six`` (round to nearest only): each block is also quantized with its amax mapped to 4,
    the largest E2M1 value but one, instead of 6 (a finer grid near the top of the block: 3 and 4 are
    both reachable where 6 would round them to 4 and 6), and keeps whichever of the two has the smaller
    squared error against ``x`` (6 on a tie). The tensor scale is the same, so a block whose amax is
    near the tensor's saturates its E4M3 scale at 448 with the 4-mapping and keeps the 6-mapping.
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_nvfp4 expects a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    if four_over_six and rounding != "nearest":
        raise ValueError(
            "four_over_six chooses a block scale by the round-to-nearest error: rounding='nearest'"
        )
    transpose, block = _orient(block)
    xf = x.float().t() if transpose else x.float()
    m, k = xf.shape
    blocks = expand_blocks(xf, block)  # [Mb, bm, Kb, bk]
    amax = blocks.abs().amax() if blocks.numel() else blocks.new_zeros(())
    ts_inv = tensor_scale_inv(amax, fmt)  # []
    block_amax = blocks.abs().amax(dim=(1, 3)) if blocks.numel() else blocks.new_zeros(blocks.shape[::2])
    noise = None
    if rounding == "stochastic":
        generator = generator if generator is not None else (_NOISE[-1] if _NOISE else None)
        noise = torch.rand(blocks.shape, generator=generator, device=blocks.device, dtype=torch.float32)
    bs_inv, codes = _encode_blocks(blocks, block_amax, amax, ts_inv, fmt.max, noise, fmt)
    if four_over_six:
        bs4, codes4 = _encode_blocks(blocks, block_amax, amax, ts_inv, fmt.values[-2], None, fmt)
        pick4 = _block_sse(blocks, codes4, bs4, ts_inv, fmt) < _block_sse(blocks, codes, bs_inv, ts_inv, fmt)
        bs_inv = torch.where(pick4, bs4.float(), bs_inv.float()).to(_SCALE.dtype)
        codes = torch.where(pick4[:, None, :, None], codes4, codes)
    data = codes.reshape(blocks.shape[0] * block[0], -1)[:m, :k]
    if transpose:
        return data.t().contiguous(), bs_inv.t().contiguous(), ts_inv
    return data.contiguous(), bs_inv, ts_inv


def _encode_blocks(
    blocks: torch.Tensor,
    block_amax: torch.Tensor,
    amax: torch.Tensor,
    ts_inv: torch.Tensor,
    top: float,
    noise: torch.Tensor | None,
    fmt: Fp4Format,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales mapping each block's amax to ``top`` and the codes of ``blocks [Mb, bm, Kb, bk]``."""
    per_block = block_amax / torch.full_like(block_amax, top)  # amax / 6, fp32
    bs_inv = (per_block / ts_inv).clamp_(_SCALE_MIN, _SCALE.max).to(_SCALE.dtype)  # RNE to E4M3
    bs_inv = torch.where(torch.isfinite(amax), bs_inv.float(), torch.nan).to(_SCALE.dtype)
    recip = ts_inv.reciprocal() / bs_inv.float()  # [Mb, Kb]: (1 / tensor) / block, as torchao
    scaled = (blocks * recip[:, None, :, None]).clamp_(-fmt.max, fmt.max)
    return bs_inv, e2m1_encode(scaled, noise, fmt)


def _block_sse(
    blocks: torch.Tensor, codes: torch.Tensor, bs_inv: torch.Tensor, ts_inv: torch.Tensor, fmt: Fp4Format
) -> torch.Tensor:
    """``[Mb, Kb]``: the squared error of each block's dequantized codes against ``blocks``, in fp64."""
    scale = (bs_inv.double() * ts_inv.double())[:, None, :, None]
    return (e2m1_decode(codes, fmt).double() * scale - blocks.double()).pow(2).sum(dim=(1, 3))


def dequantize_nvfp4(
    data: torch.Tensor,
    block_scale_inv: torch.Tensor,
    tensor_scale_inv: torch.Tensor,
    block: Block,
    dtype: torch.dtype = torch.float32,
    fmt: Fp4Format = E2M1,
) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: ``e2m1_value(data) * block_scale_inv * tensor_scale_inv``."""
    m, k = data.shape
    blocks = expand_blocks(e2m1_decode(data, fmt), block)  # [Mb, bm, Kb, bk]
    if block_scale_inv.shape != (blocks.shape[0], blocks.shape[2]):
        raise ValueError(
            f"block_scale_inv shape {tuple(block_scale_inv.shape)} does not match data "
            f"{tuple(data.shape)} with block {tuple(block)}"
        )
    scale = block_scale_inv.float() * tensor_scale_inv.float()  # [Mb, Kb]
    out = blocks * scale[:, None, :, None]
    return out.reshape(blocks.shape[0] * blocks.shape[1], -1)[:m, :k].to(dtype)
