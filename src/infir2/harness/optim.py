"""AdamW with the recipe's parameter groups, and learning-rate schedules as pure functions of the step.

Weight decay (Megatron's rule, which the InfiR2 authors trained with): every parameter with two or
more dimensions decays -- projections, ``lm_head`` and the token embedding; one-dimensional
parameters -- RMSNorm weights and biases -- never do. Master weights are fp32; the two AdamW moments
are fp32 (``optim.state_dtype: fp32``, torch's AdamW: 4 + 4 + 4 + 4 = 16 bytes per parameter with the
gradient) or bf16 (``optim.state_dtype: bf16``, ``LowPrecisionAdamW``, as Megatron's
``--exp-avg-dtype/--exp-avg-sq-dtype bf16``: 12 bytes per parameter) or FP8 (``optim.state_dtype: fp8``,
``Fp8AdamW``: block-scaled E4M3 / E5M2 codes, ``infir2.fp8.moments``; about 10.06 bytes per parameter).
Low-precision moments are only storage: each step reads them back to fp32, runs the same AdamW math as
torch in fp32, and rounds the new moments back; the update itself never sees a rounded new moment.

Schedules map ``step`` (0-based index of the optimizer step about to be taken) to a learning rate;
nothing is stored, so a resumed or decay-only run just evaluates the function at its step:

* ``wsd`` (warmup-stable-decay)::

      step < W                : lr * (step + 1) / W                       linear warmup
      W <= step < T - D       : lr                                         stable
      T - D <= step < T       : min_lr + (lr - min_lr) * f((step - (T - D)) / D)
                                f(p) = (1 + cos(pi p)) / 2   (cosine)   or   1 - p   (linear)

  so the first decay step runs at ``lr`` and the last (``T - 1``) at ``min_lr + (lr-min_lr) f((D-1)/D)``,
  reaching ``min_lr`` at ``T``.
* ``cosine``: linear warmup over W steps, then ``min_lr + (lr - min_lr) (1 + cos(pi p)) / 2`` with
  ``p = (step - W) / (T - W)``.
* ``constant``: linear warmup over W steps, then ``lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..fp8 import moments
from ..fp8.formats import BLOCK
from ..fp8.moments import SECOND_MOMENT_FORMATS, MomentCodes, dequantize_moment, quantize_moment
from .config import OptimConfig, ScheduleConfig
from .grads import drop_grads, grad_of, keep_bf16_grads

__all__ = [
    "Fp8AdamW",
    "LowPrecisionAdamW",
    "Schedule",
    "build_optimizer",
    "check_loaded_moments",
    "make_schedule",
    "param_groups",
]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: >=2-D weights decay, 1-D parameters (norms, biases) do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled decay, bias-corrected) with its moments stored in ``state_dtype``, math in fp32.

    Per parameter ``p`` with gradient ``g`` at step ``t`` (torch's AdamW, ``amsgrad=False``)::

        p *= 1 - lr * wd;   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    with ``m``, ``v`` read from and written back to ``state_dtype`` tensors. The state dict has torch
    AdamW's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load either way round.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                grad = grad_of(p)  # autograd's fp32 gradient, or the bf16 one (optim.grad_dtype)
                if grad is None:
                    continue
                state = self._moments(p)
                state["step"] += 1
                t = float(state["step"])
                w, g = _local(p), _local(grad)  # a shard's own elements (FSDP2): the update is elementwise
                for rows in _row_slices(w):  # the fp32 temporaries of one slice at a time
                    m, v = self._read(state, rows)
                    gr = g[rows].float()
                    m.lerp_(gr, 1 - beta1)
                    v.mul_(beta2).addcmul_(gr, gr, value=1 - beta2)
                    wr = w[rows]
                    wr.mul_(1 - lr * wd)
                    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                    wr.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                    self._write(state, rows, m, v)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free the gradients, the bf16 ones of ``optim.grad_dtype: bf16`` too."""
        super().zero_grad(set_to_none)
        drop_grads(p for group in self.param_groups for p in group["params"])

    def _read(self, state: dict[str, Any], rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments of ``rows`` (of this process's shard) as fp32 tensors (fp32 storage: views of it)."""
        return _local(state["exp_avg"])[rows].float(), _local(state["exp_avg_sq"])[rows].float()

    def _write(self, state: dict[str, Any], rows: slice, m: torch.Tensor, v: torch.Tensor) -> None:
        """Round the new fp32 moments of ``rows`` into their storage."""
        _local(state["exp_avg"])[rows].copy_(m)
        _local(state["exp_avg_sq"])[rows].copy_(v)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts moments to the parameter dtype (fp32); store them back in ``state_dtype``."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)

    def state_bytes(self, p: torch.Tensor) -> int:
        """The bytes of ``p``'s state once it is made (two moments and the fp32 step counter)."""
        return 2 * p.numel() * torch.empty((), dtype=self.state_dtype).element_size() + 4


class Fp8AdamW(LowPrecisionAdamW):
    """AdamW with block-scaled FP8 moments (``optim.state_dtype: fp8``; the rule: ``infir2.fp8.moments``).

    Each step reads the stored moments back to fp32, runs ``LowPrecisionAdamW``'s fp32 update with the
    new gradient, and stores the new moments again: the update never sees a rounded *new* moment, only
    the rounding of the ones carried from earlier steps. Parameters of two or more dimensions keep
    ``exp_avg`` (E4M3) and ``exp_avg_sq`` (``second_moment``: E5M2, or E4M3 of its square root) as
    uint8 codes of the parameter's shape, with fp32 ``*_scale`` tensors (one per ``block`` elements of
    a row) and, with ``expand``, ``*_exponent`` (COAT's per-block exponent); 1-D parameters (norms,
    biases: a few thousandths of a model) keep fp32 moments. Per >=2-D parameter ``2 + 8 / block``
    bytes (``+ 8 / block`` with ``expand``): 2.0625 at the default block of 128, against 8 (fp32).
    Under FSDP2 every tensor of a parameter's state is a DTensor sharded by rows like the parameter.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block: int = BLOCK,
        second_moment: str = "sqrt_e4m3",
        expand: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, state_dtype=torch.float32)
        if second_moment not in SECOND_MOMENT_FORMATS:
            raise ValueError(f"second_moment: expected one of {SECOND_MOMENT_FORMATS}, got {second_moment!r}")
        if block < 1:
            raise ValueError(f"block: expected a positive number of elements, got {block}")
        self.block, self.second_moment, self.expand = block, second_moment, expand

    def _kinds(self) -> dict[str, str]:
        return {"exp_avg": "m", "exp_avg_sq": self.second_moment}

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if state or p.dim() < 2:
            return super()._moments(p)
        state["step"] = torch.zeros((), dtype=torch.float32)
        blocks = -(-p.shape[-1] // self.block)
        for key in self._kinds():
            state[key] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            state[f"{key}_scale"] = _like_rows(p, blocks, 1.0)
            if self.expand:
                state[f"{key}_exponent"] = _like_rows(p, blocks, 1.0)
        return state

    def _stored(self, state: dict[str, Any], key: str, rows: slice) -> MomentCodes:
        exponent = state.get(f"{key}_exponent")
        return MomentCodes(
            _local(state[key])[rows],
            _local(state[f"{key}_scale"])[rows],
            None if exponent is None else _local(exponent)[rows],
        )

    def _read(self, state: dict[str, Any], rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        if state["exp_avg"].dtype != torch.uint8:  # a 1-D parameter's fp32 moments
            return super()._read(state, rows)
        m, v = (
            dequantize_moment(self._stored(state, key, rows), kind, self.block)
            for key, kind in self._kinds().items()
        )
        return m, v

    def _write(self, state: dict[str, Any], rows: slice, m: torch.Tensor, v: torch.Tensor) -> None:
        if state["exp_avg"].dtype != torch.uint8:
            return super()._write(state, rows, m, v)
        for (key, kind), value in zip(self._kinds().items(), (m, v), strict=True):
            new, old = quantize_moment(value, kind, self.block, self.expand), self._stored(state, key, rows)
            old.codes.copy_(new.codes)
            old.scale_inv.copy_(new.scale_inv)
            if old.exponent is not None and new.exponent is not None:
                old.exponent.copy_(new.exponent)
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Codes load as uint8 as they are (torch's loader would cast them to the parameter's fp32, four
        times their bytes, all at once); moments saved in fp32 or bf16 are stored as FP8 codes."""
        codes: dict[tuple[Any, str], torch.Tensor] = {}
        state = {pid: dict(s) for pid, s in state_dict["state"].items()}
        for pid, s in state.items():
            for key in [k for k, v in s.items() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8]:
                codes[pid, key] = s.pop(key)
        torch.optim.Optimizer.load_state_dict(self, {**state_dict, "state": state})
        saved_ids = (pid for g in state_dict["param_groups"] for pid in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for pid, p in zip(saved_ids, params, strict=True):
            for (owner, key), value in codes.items():
                if owner == pid:
                    self.state[p][key] = value.to(p.device)
            self._store_as_fp8(p)

    def _store_as_fp8(self, p: torch.Tensor) -> None:
        """A >=2-D parameter's moments loaded from fp32 / bf16 storage (another ``state_dtype``), as codes."""
        state = self.state.get(p)
        if p.dim() < 2 or not state or state["exp_avg"].dtype == torch.uint8:
            return
        m, v, step = _local(state["exp_avg"]).float(), _local(state["exp_avg_sq"]).float(), state["step"]
        state.clear()
        self._moments(p)["step"] = step
        self._write(self.state[p], slice(None), m, v)

    def state_bytes(self, p: torch.Tensor) -> int:
        if p.dim() < 2:
            return super().state_bytes(p)
        rows = p.numel() // p.shape[-1]
        per_moment = p.numel() + rows * -(-p.shape[-1] // self.block) * 4 * (2 if self.expand else 1)
        return 2 * per_moment + 4


def _like_rows(p: torch.Tensor, blocks: int, fill: float) -> torch.Tensor:
    """An fp32 ``[*p.shape[:-1], blocks]`` tensor of ``fill``; a DTensor sharded like ``p`` when ``p`` is one
    (FSDP2 shards leading dimensions, so each rank holds its rows' blocks)."""
    if not isinstance(p, DTensor):
        return torch.full((*p.shape[:-1], blocks), fill, dtype=torch.float32, device=p.device)
    if any(getattr(pl, "dim", None) in (-1, p.dim() - 1) for pl in p.placements):
        raise ValueError("FP8 moments: a parameter sharded along its last dimension is not supported")
    local = p.to_local()
    full = torch.full((*local.shape[:-1], blocks), fill, dtype=torch.float32, device=local.device)
    shape = torch.Size((*p.shape[:-1], blocks))
    stride = torch.empty(shape, device="meta").stride()  # contiguous
    return DTensor.from_local(full, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def _row_slices(w: torch.Tensor) -> list[slice]:
    """Slices of ``w``'s first dimension of at most ``fp8.moments.STEP_ELEMENTS`` elements (at least one
    row): the update of a larger parameter goes slice by slice, its fp32 temporaries one slice's."""
    if w.dim() == 0 or w.numel() <= moments.STEP_ELEMENTS:
        return [slice(None)]
    per_row = w.numel() // w.shape[0]
    rows = max(1, moments.STEP_ELEMENTS // per_row)
    return [slice(i, i + rows) for i in range(0, w.shape[0], rows)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP2 (DTensor) tensor, sharing its storage; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_loaded_moments(optimizer: torch.optim.Optimizer, source: str) -> None:
    """Refuse FP8 moment codes loaded into an AdamW that reads them as numbers (torch's loader casts the
    codes to fp32 without complaint): resuming an ``optim.state_dtype: fp8`` run needs the same setting."""
    if isinstance(optimizer, Fp8AdamW):
        return
    if any("exp_avg_scale" in state for state in optimizer.state.values()):
        raise ValueError(
            f"{source}: its AdamW moments are FP8 codes (saved with optim.state_dtype: fp8); resume with "
            "optim.state_dtype: fp8, or start the optimizer afresh from the weights (load.mode: weights_only)"
        )


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over fp32 master weights; fused on CUDA unless ``cfg.fused`` says otherwise.

    ``cfg.state_dtype == "bf16"``: ``LowPrecisionAdamW`` (bf16 moments); ``"fp8"``: ``Fp8AdamW`` (FP8
    codes and block scales, ``cfg.fp8_*``). ``fused`` applies to neither. ``cfg.grad_dtype == "bf16"``:
    ``model``'s gradients are kept in bf16 (``harness.grads``), read by ``LowPrecisionAdamW`` (fp32
    moments too) or ``Fp8AdamW``.
    """
    device = next(model.parameters()).device
    if cfg.grad_dtype == "bf16":
        keep_bf16_grads(model)  # torch's AdamW reads only p.grad: fp32 moments below are LowPrecisionAdamW's
    groups = param_groups(model, cfg.weight_decay)
    hyper: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.state_dtype == "fp8":
        expand = cfg.fp8_range_expansion
        return Fp8AdamW(
            groups, **hyper, block=cfg.fp8_block, second_moment=cfg.fp8_second_moment, expand=expand
        )
    if cfg.state_dtype != "fp32" or cfg.grad_dtype != "fp32":
        return LowPrecisionAdamW(groups, **hyper, state_dtype=STATE_DTYPES[cfg.state_dtype])
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, **hyper, fused=fused or None, foreach=None if fused else True)


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule with every length resolved to steps; call it with the step."""

    name: str
    lr: float
    min_lr: float
    total_steps: int
    warmup_steps: int
    decay_steps: int = 0
    decay_style: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.name == "constant":
            return self.lr
        if self.name == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            return self._anneal(min((step - self.warmup_steps) / span, 1.0), "cosine")
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start or self.decay_steps == 0:
            return self.lr
        return self._anneal(min((step - decay_start) / self.decay_steps, 1.0), self.decay_style)

    def _anneal(self, progress: float, style: str) -> float:
        factor = (1 + math.cos(math.pi * progress)) / 2 if style == "cosine" else 1 - progress
        return self.min_lr + (self.lr - self.min_lr) * factor


def make_schedule(cfg: ScheduleConfig, lr: float, total_steps: int) -> Schedule:
    """Resolve fractions against ``total_steps`` and ``min_lr_ratio`` against ``lr``."""
    if total_steps <= 0:
        raise ValueError(f"schedule needs a positive number of steps, got {total_steps}")
    warmup = (
        cfg.warmup_steps
        if cfg.warmup_steps is not None
        else round((cfg.warmup_fraction or 0.0) * total_steps)
    )
    if cfg.name == "wsd":
        decay = (
            cfg.decay_steps
            if cfg.decay_steps is not None
            else round((cfg.decay_fraction or 0.0) * total_steps)
        )
    else:
        decay = 0
    if warmup + decay > total_steps:
        raise ValueError(
            f"schedule: warmup ({warmup}) + decay ({decay}) steps exceed the {total_steps} training steps"
        )
    if cfg.min_lr is not None:
        min_lr = cfg.min_lr
    elif cfg.min_lr_ratio is not None:
        min_lr = cfg.min_lr_ratio * lr
    else:
        min_lr = 0.0 if cfg.name != "constant" else lr
    return Schedule(cfg.name, lr, min_lr, total_steps, warmup, decay, cfg.decay_style)
