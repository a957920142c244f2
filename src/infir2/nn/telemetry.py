"""FP8 numerics telemetry: what each ``Fp8Linear`` does to each operand it quantizes, per layer.

Opt-in (``fp8.stats_every: N`` in a run config; 0, the default, is off). Off, the only cost is one
attribute check per forward (``Fp8Linear.stats is None``). On, every N-th optimizer step is a
*stats step*: :meth:`Fp8Telemetry.record` attaches a :class:`LayerStats` to every ``Fp8Linear`` for
that step only, and the layer's forward / backward hand it the operands they already computed.
Values and gradients are never changed: the recorder only reads.

Per layer and per quantized operand (``<gemm>.<operand>``: ``fprop.x``, ``fprop.w``, ``dgrad.dy``,
``dgrad.w``, ``wgrad.dy``, ``wgrad.x``), over all micro-batches of the stats step:

* ``amax``         the largest magnitude of the high-precision operand;
* ``underflow``    the fraction of its non-zero elements whose FP8 code is zero (flushed by the
                   block's scale: an outlier in the block, or a scale clamped at its largest value);
* ``saturation``   the fraction of its elements at the format's max (448 for E4M3);
* ``log2_scale_inv_min`` / ``log2_scale_inv_max``: the range of ``log2(scale_inv)`` over its blocks
                   (integers for pow2 / E8M0 scales; a block whose amax is 0 has ``scale_inv = 1``,
                   so 0).

And, on the first micro-batch of the stats step, the SQNR (``infir2.fp8.sqnr``, dB) of each GEMM's
result against the same GEMM recomputed in fp32 from the unquantized operands::

    fprop.y   Y  vs  X @ W.T (+ b)          dgrad.dx  dX vs  dY @ W          wgrad.dw  dW vs  dY.T @ X

The wgrad reference needs the high-precision X, which ``Fp8Linear`` does not keep (only its FP8
wgrad copy): on that one micro-batch the recorder holds a reference to X until the layer's backward
(q/k/v share one input tensor, gate/up another, so this is no copy but keeps those tensors alive).
Cost on a stats step: a few elementwise passes per operand, three fp32 GEMMs and their fp64 SQNR per
layer on one micro-batch; a handful of host syncs per layer when the step's numbers are read.

The numbers come back as flat keys ``fp8/<layer fqn>/<gemm>.<operand>/<stat>`` (``parse_key`` splits
one), which the training loop writes to ``metrics.jsonl`` and TensorBoard; ``infir2 numerics RUN_DIR``
ranks the layers and draws them over steps. Under torchrun each rank records its own micro-batches
and the main rank's are written. Under activation checkpointing a recomputed forward counts its
operands twice, which leaves every fraction, amax and range unchanged. Weights all-gathered as FP8 codes (``fp8.param_gather``) have no
high-precision copy on the rank: their ``w`` statistics and the SQNRs are not recorded. The experts
of an MoE block (``Fp8Experts``) report per expert weight, over all their experts
(``infir2.nn.moe.telemetry``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..fp8.formats import get_format
from ..fp8.numerics import sqnr
from ..fp8.recipe import Cast
from ..kernels import Operand
from .fsdp import Fp8GatheredWeight
from .linear import Fp8Linear
from .moe import Fp8Experts

__all__ = [
    "OPERAND_STATS",
    "PREFIX",
    "SQNR_STAT",
    "Fp8Telemetry",
    "LayerStats",
    "operand_counts",
    "parse_key",
]

#: The first component of every telemetry key.
PREFIX = "fp8"
#: The statistics of each quantized operand, in key order.
OPERAND_STATS = ("amax", "underflow", "saturation", "log2_scale_inv_min", "log2_scale_inv_max")
#: The statistic of each GEMM result (``fprop.y``, ``dgrad.dx``, ``wgrad.dw``).
SQNR_STAT = "sqnr_db"

_MAGNITUDE = 0x7F  # the bits of an FP8 code below its sign bit (the same for E4M3 and E5M2)
# counts of one operand: amax, underflowed, non-zero, saturated, elements, min and max scale exponent
_AMAX, _UNDER, _NONZERO, _SAT, _N, _EMIN, _EMAX = range(7)


def _max_code(fmt: str) -> torch.Tensor:
    """The magnitude bits of the FP8 code of the format's largest finite value (a 0-d uint8 tensor)."""
    f = get_format(fmt)
    return torch.tensor(f.max).to(f.dtype).view(torch.uint8) & _MAGNITUDE


def operand_counts(x: torch.Tensor, op: Operand, cast: Cast) -> torch.Tensor:
    """The raw counts of one quantization of ``x [M, K]`` into ``op`` (same orientation), fp64 ``[7]``.

    Read on the FP8 codes, not on dequantized values: a code whose magnitude bits are 0 is a zero,
    one equal to the max's code is saturated (NaN codes are neither).
    """
    x = x.detach()
    magnitude = op.data.view(torch.uint8) & _MAGNITUDE
    nonzero = x != 0
    exps = torch.log2(op.scale_inv.float())
    return torch.stack(
        [
            x.abs().amax().double() if x.numel() else x.new_zeros((), dtype=torch.float64),
            (nonzero & (magnitude == 0)).sum().double(),
            nonzero.sum().double(),
            (magnitude == _max_code(cast.fmt).to(magnitude.device)).sum().double(),
            torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
            exps.amin().double(),
            exps.amax().double(),
        ]
    )


def _merge(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    if a is None:
        return b
    out = a + b
    out[_AMAX] = torch.maximum(a[_AMAX], b[_AMAX])
    out[_EMIN] = torch.minimum(a[_EMIN], b[_EMIN])
    out[_EMAX] = torch.maximum(a[_EMAX], b[_EMAX])
    return out


def parse_key(key: str) -> tuple[str, str, str] | None:
    """``fp8/<layer>/<gemm>.<operand>/<stat>`` -> ``(layer, "<gemm>.<operand>", stat)``; None otherwise."""
    head, _, rest = key.partition("/")
    parts = rest.rsplit("/", 2)
    if head != PREFIX or len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


class _Probe:
    """What one forward call hands to its backward: the layer's recorder, and X for the SQNR micro-batch."""

    def __init__(self, stats: LayerStats, x: torch.Tensor | None) -> None:
        self.stats, self.x = stats, x

    def dgrad(
        self, dy: torch.Tensor, dyq: Operand, w_dgrad: Operand, weight: torch.Tensor, dx: torch.Tensor
    ) -> None:
        s, recipe = self.stats, self.stats.recipe
        s.add("dgrad.dy", dy, dyq, recipe.dy)
        if not isinstance(weight, Fp8GatheredWeight):
            s.add("dgrad.w", weight, w_dgrad, recipe.w_dgrad)
            if self.x is not None:  # [T,N] @ [N,K] -> [T,K]
                s.add_sqnr("dgrad.dx", dy.detach().float() @ weight.detach().float(), dx)

    def wgrad(self, dy: torch.Tensor, dy_w: Operand, dw: torch.Tensor) -> None:
        self.stats.add("wgrad.dy", dy, dy_w, self.stats.recipe.dy_wgrad)
        if self.x is not None:  # [N,T] @ [T,K] -> [N,K]
            self.stats.add_sqnr("wgrad.dw", dy.detach().float().t() @ self.x.float(), dw)
        self.x = None


class LayerStats:
    """The recorder one ``Fp8Linear`` calls while it is attached (its ``stats`` attribute)."""

    def __init__(self, telemetry: Fp8Telemetry, name: str, layer: Fp8Linear | Fp8Experts) -> None:
        self.telemetry, self.name, self.recipe = telemetry, name, layer.recipe
        self.sqnr_taken = False  # the first forward of the step measures SQNR, the others only count

    def add(self, operand: str, x: torch.Tensor, op: Operand, cast: Cast) -> None:
        key = f"{self.name}/{operand}"
        ops = self.telemetry.counts
        ops[key] = _merge(ops.get(key), operand_counts(x, op, cast))

    def add_sqnr(self, result: str, reference: torch.Tensor, got: torch.Tensor) -> None:
        self.telemetry.sqnrs[f"{self.name}/{result}"] = sqnr(reference, got)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x_ops: tuple[Operand, Operand],
        w_fprop: Operand,
        y: torch.Tensor,
    ) -> _Probe:
        """Called by the layer's forward with ``x [T,K]``, its operands and ``y [T,N]``."""
        self.add("fprop.x", x, x_ops[0], self.recipe.x)
        self.add("wgrad.x", x, x_ops[1], self.recipe.x_wgrad)
        hp_weight = not isinstance(weight, Fp8GatheredWeight)
        if hp_weight:
            self.add("fprop.w", weight, w_fprop, self.recipe.w)
        keep_x = hp_weight and not self.sqnr_taken
        if keep_x:
            self.sqnr_taken = True
            reference = x.detach().float() @ weight.detach().float().t()  # [T,K] @ [K,N] -> [T,N]
            if bias is not None:
                reference = reference + bias.detach().float()
            self.add_sqnr("fprop.y", reference, y)
        return _Probe(self, x.detach() if keep_x else None)


class Fp8Telemetry:
    """FP8 numerics of every ``Fp8Linear`` of ``model``, recorded every ``every`` steps (0: never).

    Use :meth:`record` around one optimizer step: it yields a dict that holds the step's telemetry
    (keys ``fp8/<layer>/<gemm>.<operand>/<stat>``) once the block exits, and stays empty on the
    other steps, where no layer is touched.
    """

    def __init__(self, model: nn.Module, every: int) -> None:
        if every < 0:
            raise ValueError(f"stats_every must be >= 0 (0 = off), got {every}")
        self.every = every
        self.layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Fp8Linear | Fp8Experts)]
        self.counts: dict[str, torch.Tensor] = {}
        self.sqnrs: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return self.every > 0 and bool(self.layers) and step % self.every == 0

    @contextmanager
    def record(self, step: int) -> Iterator[dict[str, float]]:
        """Attach the recorders for optimizer step ``step`` (1-based) if it is a stats step."""
        out: dict[str, float] = {}
        if not self.due(step):
            yield out
            return
        for fqn, m in self.layers:
            # one recorder per FP8 weight: an Fp8Experts' two are named apart (infir2.nn.moe.telemetry)
            experts = isinstance(m, Fp8Experts)
            m.stats = {p: LayerStats(self, f"{fqn}.{p}" if experts else fqn, m) for p in m.FP8_WEIGHTS}
        try:
            yield out
            out.update(self._collect())
        finally:
            for _, m in self.layers:
                m.stats = None
            self.counts, self.sqnrs = {}, {}

    def _collect(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, counts in self.counts.items():
            amax, under, nonzero, sat, n, emin, emax = counts.tolist()  # the one host sync, per operand
            values = (amax, under / nonzero if nonzero else 0.0, sat / n if n else 0.0, emin, emax)
            out.update({f"{PREFIX}/{key}/{stat}": v for stat, v in zip(OPERAND_STATS, values, strict=True)})
        out.update({f"{PREFIX}/{key}/{SQNR_STAT}": v for key, v in self.sqnrs.items()})
        return out
