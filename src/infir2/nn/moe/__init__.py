"""The routed experts of transformers v5 MoE blocks in FP8: ``Fp8Experts`` and what serves it.

experts         ``Fp8Experts`` (an ``Fp8Module``): the experts module it replaces, which ones it takes
grouped_linear  ``fp8_grouped_linear``: rows sorted by expert through ``[E, N, K]``, three FP8 GEMMs per expert
ops             the ``torch.compile`` custom ops of the grouped linear
fsdp            FSDP2's FP8 all-gather of expert weights (``Fp8ShardedExperts``, ``ExpertOperands``)
routing         routing replay (R3): record the experts a forward chose, make a later forward use them
telemetry       the FP8 numerics of the experts on a stats step (``ExpertsProbe``)
"""

from .experts import Fp8Experts, expert_counts, is_routed_experts, unsupported_experts_reason
from .grouped_linear import fp8_grouped_linear
from .routing import NO_ROUTE, ROUTE_DTYPE, record_routes, replay_routes, routers

__all__ = [
    "NO_ROUTE",
    "ROUTE_DTYPE",
    "Fp8Experts",
    "expert_counts",
    "fp8_grouped_linear",
    "is_routed_experts",
    "record_routes",
    "replay_routes",
    "routers",
    "unsupported_experts_reason",
]
