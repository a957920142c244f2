"""What a plan is asked about: one run's settings (``PlanInputs``; an RL run's, ``RLInputs``), apart from the
model's shape."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..nn.module import WEIGHT_SCOPES
from .measure import DEVICES

__all__ = ["BF16_BYTES", "FP32_BYTES", "WEIGHT_SCOPES", "PlanInputs", "RLInputs"]

FP32_BYTES, BF16_BYTES = 4, 2


@dataclass(frozen=True)
class PlanInputs:
    """One training run as the planner sees it; ``recipe`` is ``bf16`` (the baseline) or an FP8 recipe.

    ``device="cpu"`` plans a CPU run (per process): fp32 compute without autocast, so ``precision`` is
    then fp32. ``param_gather``: as ``fp8.param_gather`` (None: the recipe's default). ``context``:
    context parallelism (``parallel.context``); ``gpus`` is data x context. ``weight_cache``: as
    ``fp8.weight_cache`` (``infir2.nn.module``: how long the FP8 weight copies live).
    """

    recipe: str
    gpus: int = 1
    seq_len: int = 8192
    micro_batch: int = 1
    global_batch: int | None = None
    activation_checkpointing: bool = False
    state_dtype: str = "fp32"  # AdamW's moments: fp32, bf16 or fp8 (``planning.optimizer``)
    state_block: int = 128  # fp8 moments: elements of a row per scale
    state_expand: bool = False  # fp8 moments: COAT's range expansion (its step's temporaries)
    grad_dtype: str = "fp32"  # gradients' storage: fp32, or bf16 (one process; ``planning.optimizer``)
    loss_chunk_tokens: int | str = "auto"
    recompute_mlp: bool = True
    recompute_norm: bool = True
    mlp_saved_fp8: bool = False  # the SwiGLU recompute's inputs kept in FP8 (``model.mlp_saved_fp8``)
    precision: str = "bf16"
    param_gather: bool | None = None
    device: str = "cuda"
    context: int = 1
    weight_cache: str = "layer"

    def __post_init__(self) -> None:
        if self.weight_cache not in WEIGHT_SCOPES:
            raise ValueError(
                f"weight_cache: expected one of {', '.join(WEIGHT_SCOPES)}, got {self.weight_cache!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.mlp_saved_fp8 and not self.recompute_mlp:
            raise ValueError(
                "mlp_saved_fp8: keeps the SwiGLU recompute's inputs in FP8; it needs recompute_mlp"
            )
        if self.state_dtype not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"state_dtype: expected fp32, bf16 or fp8, got {self.state_dtype!r}")
        if self.grad_dtype not in ("fp32", "bf16") or (self.grad_dtype == "bf16" and self.gpus > 1):
            raise ValueError(
                f"optim.grad_dtype {self.grad_dtype!r} on {self.gpus} GPUs: fp32, or bf16 in one process only "
                "(under FSDP2 each rank's gradient shard is fp32)"
            )
        if self.context < 1 or self.gpus % self.context:
            raise ValueError(
                f"context: {self.context} must be >= 1 and divide gpus={self.gpus} (the GPUs are data x context)"
            )

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def wire(self) -> int:
        """Bytes per element of the parameters FSDP gathers (``precision``; fp32 on a CPU)."""
        return BF16_BYTES if self.precision == "bf16" and not self.cpu else FP32_BYTES

    @property
    def tokens(self) -> int:
        """This GPU's share of each micro-batch (``seq_len / context`` tokens of each sequence)."""
        return self.seq_len * self.micro_batch // self.context

    @property
    def micro_steps(self) -> int:
        """Micro-batches each GPU accumulates per optimizer step (at least 1)."""
        return max((self.global_batch or self.micro_batch * self.data) // (self.micro_batch * self.data), 1)

    @property
    def data(self) -> int:
        """The data-parallel replicas: micro-batches one forward on every GPU takes."""
        return self.gpus // self.context


@dataclass(frozen=True, kw_only=True)
class RLInputs:
    """One RL run as the planner sees it (``planning.rl.plan_rl``), apart from the model's shape and
    where it runs (GPUs, prompt length, device): what ``rl.plan.plan_inputs`` reads from an ``RLConfig``.

    Every field is given (no defaults: the config's are the one declaration). The update's settings are
    ``PlanInputs``'s (``recipe`` to ``context``); the rest is what RL keeps
    besides: ``micro_batch`` (``algo.micro_batch_size``), the rollout's ``max_new_tokens``,
    ``rollout_batch`` (``rollout.batch_size``) and ``rollout_precision`` (``high`` or ``fp8``), and
    ``keeps_reference``: whether the run holds a whole copy of the start model (``rl.config.keeps_reference``).
    """

    recipe: str
    precision: str  # model.precision (fp64 is planned as fp32: the same bytes on the wire)
    activation_checkpointing: bool
    recompute_mlp: bool
    recompute_norm: bool
    mlp_saved_fp8: bool
    state_dtype: str
    state_block: int
    state_expand: bool
    grad_dtype: str
    context: int
    micro_batch: int
    max_new_tokens: int
    rollout_batch: int
    rollout_precision: str
    keeps_reference: bool

    def __post_init__(self) -> None:
        if self.rollout_precision not in ("high", "fp8"):
            raise ValueError(f"rollout_precision: expected high or fp8, got {self.rollout_precision!r}")
        for key in ("context", "micro_batch", "max_new_tokens", "rollout_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")

    def update(self, gpus: int, seq_len: int, device: str) -> PlanInputs:
        """The policy's update as a training step: ``micro_batch`` sequences of ``seq_len`` tokens, the
        fields both records name alike taken over, the scorer's chunked logits (``PlanInputs``'s
        default ``loss_chunk_tokens="auto"``)."""
        own = {f.name for f in fields(self)}
        same = {f.name: getattr(self, f.name) for f in fields(PlanInputs) if f.name in own}  # by name
        wire = "fp32" if self.precision == "fp64" else self.precision
        return PlanInputs(**same | {"precision": wire, "gpus": gpus, "seq_len": seq_len, "device": device})
