"""The real training step under ``FakeTensorMode``, its memory tracked: a check of the planner.

``fake_step`` builds a shipped model shape (``planning.MODELS``) as training does (``model.
prepare_for_training``: fp32 masters, activation checkpointing, the SwiGLU recompute, the FP8 swap)
on fake tensors (shapes and dtypes, no data: a 7B step in seconds, no memory), and runs ``train.loop.
train_step`` itself -- the token scorer's loss, backward inside ``cache_fp8_weights``, the clip, the
optimizer of ``harness.optim.build_optimizer`` -- twice (the first step creates the moments; the
second is the one measured) under torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``,
as torchtitan's ``scripts/estimate/estimation.py`` does). So a term of the analytic planner
(``planning.plan``) that the step changes cannot go stale unseen: ``tests/test_plan_vs_fake_step.py``
compares them, ``benchmarks/plan_vs_fake_step.py`` prints them at full 1.5B / 7B shape.

A CPU step: fp32, no autocast (``model.precision: fp32``), what ``plan(..., device="cpu")`` plans. The
FP8 kernels are the CPU chain's (``fast_emulated``): its C kernel reads data pointers, which a fake
tensor has none of, so it steps aside for fake tensors and the kernel's eager code runs (the same
tensors kept; its transients are eager torch's, not the C loop's). Values are not computed, so each
scalar the step reads (loss, gradient norm, token counts, AdamW's step count) is read as 1: the loss
is finite, the step is taken and the gradients are clipped (in place).

Measured (bytes): ``parameters``; ``gradients`` (the most gradient bytes alive at once, counted as each
gradient arrives: fp32 ``p.grad`` or the bf16 copies ``optim.grad_dtype: bf16`` keeps); ``optimizer``
(the moments after the step); ``activations`` (the most bytes in forward + backward that are none of
those three: saved activations, weight copies, the loss's blocks, backward's temporaries); the peak of
forward + backward, of the optimizer step, and of the whole step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode

from .._dist import DistEnv
from ..harness.config import OptimConfig
from ..harness.grads import grad_of
from ..harness.optim import build_optimizer
from ..model import build_from_config, prepare_for_training
from ..planning import MODELS, ModelShape, Plan, plan
from ..train.loop import train_step

__all__ = ["FakeStep", "StepSettings", "compare", "fake_step", "model_fields"]

CPU = torch.device("cpu")


@dataclass(frozen=True)
class StepSettings:
    """One step's settings, as ``PlanInputs`` names them (one process, a CPU, fp32)."""

    recipe: str = "blockwise"
    seq_len: int = 8192
    micro_batches: int = 1
    activation_checkpointing: bool = True
    state_dtype: str = "fp32"
    grad_dtype: str = "fp32"
    weight_cache: str = "layer"
    backend: str | None = None  # the FP8 backend (``fp8.backend``); None: the CPU chain

    def plan(self, shape: ModelShape) -> Plan:
        """What the planner says of this step (``device="cpu"``)."""
        return plan(
            shape,
            self.recipe,
            seq_len=self.seq_len,
            global_batch=self.micro_batches,
            activation_checkpointing=self.activation_checkpointing,
            state_dtype=self.state_dtype,
            grad_dtype=self.grad_dtype,
            weight_cache=self.weight_cache,
            device="cpu",
        )


@dataclass(frozen=True)
class FakeStep:
    """The tracked bytes of one step (module doc)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    backward_peak: int
    step_peak: int

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.step_peak)


def model_fields(model: str, layers: int | None = None) -> dict[str, Any]:
    """``model``'s config fields (``planning.MODELS``), with ``layers`` decoder layers if given."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    fields = dict(MODELS[model])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return fields


class _ScalarReads(TorchDispatchMode):
    """Each read of a fake tensor's value (``.item()``, ``float()``, ``.tolist()``) returns 1."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


class _GradientBytes:
    """The gradient bytes alive (``alive``) and the most at once (``peak``): the stored gradients (fp32
    ``p.grad`` or the bf16 copy) plus the one autograd hands over as it arrives (a tensor hook, before
    it is accumulated); refreshed after each accumulation (a hook after ``harness.grads``' own)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params, self.alive, self.peak, self.measuring = params, 0, 0, False
        self.handles = [p.register_hook(self._arrives) for p in params]
        self.handles += [p.register_post_accumulate_grad_hook(self._stored) for p in params]

    def stored(self) -> int:
        return sum(g.untyped_storage().nbytes() for g in map(grad_of, self.params) if g is not None)

    def _arrives(self, grad: torch.Tensor) -> None:
        self.alive = self.stored() + grad.untyped_storage().nbytes()
        if self.measuring:
            self.peak = max(self.peak, self.alive)

    def _stored(self, _p: torch.Tensor) -> None:
        self.alive = self.stored()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _StepTracker(MemTracker):
    """``MemTracker`` with the peaks of forward + backward and of the optimizer step apart, and the most
    bytes that are none of parameters, moments and gradients (``grads``) in forward + backward."""

    def __init__(self, grads: _GradientBytes) -> None:
        super().__init__()
        self.grads, self.measuring = grads, False
        self.peaks = {"backward": 0, "optimizer": 0, "activations": 0}

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        """A root module's forward again (the next micro-batch or step): its stats start afresh
        (``MemTracker`` refuses a second iteration otherwise); the bytes tracked stay."""
        parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
        if module in self.memory_tracking and not self._mod_tracker.is_bw and parents == {"Global"}:
            self.reset_mod_stats()
            self.grads.alive = self.grads.stored()  # the last step's were freed by zero_grad
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        if not self.measuring:
            return
        snap = {str(k): v for k, v in self._curr_mem_snap.get(CPU, {}).items()}
        total = snap.get("Total", 0)
        if self._in_opt:
            self.peaks["optimizer"] = max(self.peaks["optimizer"], total)
            return
        self.peaks["backward"] = max(self.peaks["backward"], total)
        states = sum(snap.get(str(k), 0) for k in (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.OPT))
        self.peaks["activations"] = max(self.peaks["activations"], total - states - self.grads.alive)


@contextmanager
def _fake_mode() -> Iterator[FakeTensorMode]:
    """Fake tensors; real ones that meet them (the meta model's ``to_empty``, constants) made fake.

    transformers takes a fake tensor for a traced graph and then builds the ``[T, T]`` causal mask that
    a real step leaves to SDPA's ``is_causal`` (``masking_utils._ignore_causal_mask_sdpa``): 256 MiB
    at 8k tokens that no real step holds. Inside, its check sees a fake tensor as a real one."""
    from transformers import masking_utils

    real_check = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: real_check(None)  # compile / export / jit still count
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        masking_utils.is_tracing = real_check


def fake_step(fields: dict[str, Any], settings: StepSettings) -> FakeStep:
    """Two steps of ``train_step`` on a fake model of ``fields`` (``model_fields``); the second's bytes."""
    model = build_from_config({"arch": "qwen2", **fields}, device="meta")
    model = prepare_for_training(
        model, settings.recipe, settings.backend, settings.activation_checkpointing
    )  # on the meta device: fake parameters cannot be converted in place (``nn.Module._apply``)
    env = DistEnv(rank=0, world_size=1, device=CPU, owns_group=False)
    with _fake_mode():
        model.to_empty(device=CPU)
        hf_model: Any = model
        hf_model.tie_weights()  # to_empty made the tied embedding and head two tensors
        optim = OptimConfig(state_dtype=settings.state_dtype, grad_dtype=settings.grad_dtype)  # type: ignore[arg-type]
        optimizer = build_optimizer(model, optim)
        ids = torch.zeros(1, settings.seq_len, dtype=torch.long)
        batch = [{"input_ids": ids, "labels": ids.clone()} for _ in range(settings.micro_batches)]
        grads = _GradientBytes([p for p in model.parameters() if p.requires_grad])
        tracker = _StepTracker(grads)
        tracker.track_external(model, optimizer, *(t for mb in batch for t in mb.values()))

        def step() -> None:
            lr, clip = optim.lr, optim.grad_clip
            train_step(model, optimizer, batch, lr, clip, "fp32", env, weight_cache=settings.weight_cache)

        with tracker, _ScalarReads():
            step()  # the first step creates the moments
            tracker.measuring = grads.measuring = True
            step()
        grads.close()
        snap = {str(k): v for k, v in tracker.get_tracker_snapshot("current")[CPU].items()}
    opt_key, param_keys = str(_MemRefType.OPT), (str(_MemRefType.PARAM), str(_MemRefType.BUFFER))
    parameters, moments = sum(snap[k] for k in param_keys), snap[opt_key]
    return FakeStep(
        parameters=parameters,
        gradients=grads.peak,
        optimizer=moments,
        activations=tracker.peaks["activations"],
        backward_peak=tracker.peaks["backward"],
        step_peak=tracker.peaks["optimizer"],
    )


#: the terms ``compare`` lines up (``FakeStep``'s names)
TERMS: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "backward_peak",
    "step_peak",
    "peak",
)


def compare(measured: FakeStep, planned: Plan) -> dict[str, tuple[float, float]]:
    """Per term: (planned bytes, tracked bytes). ``activations`` is the plan's weight copies, activations
    and logits (saved, and made in backward); ``step_peak`` the plan's parameters, gradients, moments
    and step temporaries."""
    plan_activations = planned.backward_peak - planned.parameters - planned.gradients - planned.optimizer
    planned_terms = {
        "parameters": planned.parameters,
        "gradients": planned.gradients,
        "optimizer": planned.optimizer,
        "activations": plan_activations,
        "backward_peak": planned.backward_peak,
        "step_peak": planned.step_peak,
        "peak": planned.peak,
    }
    return {name: (planned_terms[name], float(getattr(measured, name))) for name in TERMS}
