"""The memory planner under ``infir2 plan`` and ``infir2 rl``: bytes per GPU of a run, before it starts.

One inputs record (``PlanInputs``: a run's settings; ``RLInputs``: an RL run's, built in ``rl/``) over
a model's shape (``ModelShape``), and one module per term: ``dense`` (the training step: states, gathered weights, weight copies, activations,
logits, all-gather), ``moe`` (an MoE layer from the dense layer of its active width), ``context``
(context parallelism's gathered keys and values), ``rl`` (an RL step: reference, engine, KV cache,
scoring); ``layer`` (one layer's measured figures, ``measure``), ``fit`` and ``format`` (what the
command prints). Below the stages: ``rl/`` plans its own step here (``planning.check``); the command
is ``tools/plan.py``.
"""

from __future__ import annotations

from .context import check_context, context_kv_bytes
from .dense import Plan, plan, plan_step
from .fit import GPU_GIB, USABLE, fewest_gpus, fit_advice, rl_fit, what_fits
from .format import PUBLISHED, format_plan, format_rl_plan
from .inputs import WEIGHT_SCOPES, PlanInputs, RLInputs
from .layer import MEASURED, MEASURED_CPU, layer_figures
from .moe import MOE_NOTE
from .rl import RLPlan, plan_rl
from .shape import MODELS, ModelShape, load_shape, unmodelled

__all__ = [
    "GPU_GIB",
    "MEASURED",
    "MEASURED_CPU",
    "MODELS",
    "MOE_NOTE",
    "PUBLISHED",
    "USABLE",
    "WEIGHT_SCOPES",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "RLInputs",
    "RLPlan",
    "check_context",
    "context_kv_bytes",
    "fewest_gpus",
    "fit_advice",
    "format_plan",
    "format_rl_plan",
    "layer_figures",
    "load_shape",
    "plan",
    "plan_rl",
    "plan_step",
    "rl_fit",
    "unmodelled",
    "what_fits",
]
