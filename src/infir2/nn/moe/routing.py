"""Routing replay (R3): record the experts a rollout's forwards chose, and make a later forward use them.

transformers v5's MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3) route through a router module
(``mlp.gate``) that returns ``(router_logits, top_k_weights, top_k_index)`` and hand the last two to the
experts. ``routers(model)`` finds the routers of the blocks whose ``experts`` are routed experts, in layer
order. Two context managers hook them (forward hooks, removed on exit):

* ``record_routes(model, rows)`` -- every forward's ``top_k_index`` per layer; ``RouteLog.routes()`` lays
  the forwards of a left-padded batch of ``rows`` sequences side by side: ``[rows, columns, layers, k]``
  int16, one column per token fed (a prefill's tokens, then one per decode step);
* ``replay_routes(model, routes)`` -- ``routes`` ``[B, S, layers, k]`` (this forward's ``[B, S]`` tokens),
  ``-1`` where a token has no record (padding, a response's last token): each recorded token goes to the
  recorded experts, the others to the router's own choice. The routing weights are the router's own
  formula evaluated at the replayed experts (softmax routers: the softmax probabilities gathered there,
  renormalised where the router renormalises; DeepSeek-V3: the sigmoid scores, renormalised, times
  ``routed_scaling_factor``), from the live logits, so the router still gets its gradient. A token whose
  recorded expert set is the router's own keeps the router's output as it is (its order, its weights):
  replaying routes that agree changes nothing, bit for bit.
  ``ReplayStats.counts`` ``[layers, 2]``: the recorded tokens compared, and those whose expert set the
  router would have chosen differently.

A dense model has no routers: both are no-ops there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .experts import Fp8Experts, is_routed_experts

__all__ = ["NO_ROUTE", "ROUTE_DTYPE", "ReplayStats", "RouteLog", "record_routes", "replay_routes", "routers"]

#: the stored dtype of an expert id (DeepSeek-V3's 256 experts do not fit uint8) and "no record"
ROUTE_DTYPE = torch.int16
NO_ROUTE = -1


def routers(model: nn.Module) -> list[nn.Module]:
    """The routers (``gate``) of ``model``'s MoE blocks with routed experts, in layer order."""
    found = []
    for module in model.modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        if not isinstance(experts, nn.Module) or not isinstance(gate, nn.Module):
            continue
        if isinstance(experts, Fp8Experts) or is_routed_experts(experts):
            found.append(gate)
    return found


def _replayed_weights(
    router: nn.Module, logits: torch.Tensor, index: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """The router's routing weights of the experts ``index`` ``[T, k]`` (module doc), in ``like``'s dtype."""
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid scores, no bias in the weights
        w = logits.sigmoid().gather(1, index)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return (w * float(router.routed_scaling_factor)).to(like.dtype)  # type: ignore[arg-type]
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(like.dtype)


class RouteLog:
    """What ``record_routes`` saw: per layer, each forward's ``[tokens, k]`` expert ids."""

    def __init__(self, layers: int, rows: int) -> None:
        self.rows = rows
        self.seen: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def routes(self) -> torch.Tensor | None:
        """``[rows, columns, layers, k]`` int16 (module doc); None for a dense model or no forward."""
        if not self.seen or not self.seen[0]:
            return None
        per_layer = [torch.cat([f.reshape(self.rows, -1, f.shape[-1]) for f in s], 1) for s in self.seen]
        return torch.stack(per_layer, dim=2).cpu()  # off the hot path: one copy per generate call, at its end


#: ``hook(layer, router, output)``: called after each router's forward; a return value replaces the output
RouterHook = Callable[[int, nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], Any]


@contextmanager
def _on_routers(gates: list[nn.Module], hook: RouterHook) -> Iterator[None]:
    """``hook`` on the forward of each router of ``gates`` (layer ``i`` = ``gates[i]``) while held."""

    def bound(layer: int) -> Callable[[nn.Module, Any, Any], Any]:
        def call(module: nn.Module, args: Any, out: Any) -> Any:
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError(
                    f"routing replay: {type(module).__name__} returns {type(out).__name__}, not the "
                    "(router_logits, top_k_weights, top_k_index) of transformers' MoE routers"
                )
            return hook(layer, module, out)

        return call

    handles = [g.register_forward_hook(bound(i)) for i, g in enumerate(gates)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def record_routes(model: nn.Module, rows: int) -> Iterator[RouteLog]:
    """Record the experts every forward of ``model`` chooses (module doc) while held."""
    gates = routers(model)
    log = RouteLog(len(gates), rows)

    def record(layer: int, module: nn.Module, out: tuple[torch.Tensor, ...]) -> None:
        log.seen[layer].append(out[2].detach().to(ROUTE_DTYPE))  # kept on the device: no sync per step

    with _on_routers(gates, record):
        yield log


class ReplayStats:
    """Per layer: recorded tokens compared, and those the router would have routed elsewhere."""

    def __init__(self, layers: int, count: bool, device: torch.device | None = None) -> None:
        self.counts = torch.zeros(layers, 2, dtype=torch.int64, device=device)  # summed on the device
        self.count = count


def _differ(fresh: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """``[T]`` True where the two expert sets differ (the order of the k ids does not matter)."""
    return (fresh.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor | None, count: bool = True) -> Iterator[ReplayStats]:
    """Route ``model``'s forwards by ``routes`` while held (module doc); None: route as ever. ``count``:
    add every forward's compared and differing tokens to the stats (a recomputing backward would add
    them twice: the update leaves it off)."""
    gates = routers(model) if routes is not None else []
    device = next(model.parameters()).device
    stats = ReplayStats(len(gates), count, device)
    if gates and routes is not None and routes.shape[2] != len(gates):
        raise ValueError(f"routes for {routes.shape[2]} MoE layers, but the model has {len(gates)}")
    if gates and routes is not None:
        routes = routes.to(device)  # once, not per layer

    def replay(layer: int, module: nn.Module, out: tuple[torch.Tensor, ...]) -> Any:
        logits, weights, fresh = out
        assert routes is not None
        recorded = routes[:, :, layer].reshape(-1, fresh.shape[-1]).to(fresh.device, fresh.dtype)
        if recorded.shape[0] != fresh.shape[0]:
            raise ValueError(f"routes for {recorded.shape[0]} tokens, but the forward has {fresh.shape[0]}")
        known = (recorded >= 0).all(dim=-1)
        differ = _differ(fresh, recorded) & known  # elsewhere the router's own output stands
        if stats.count:
            stats.counts[layer] += torch.stack([known.sum(), differ.sum()]).to(stats.counts.device)
        index = torch.where(differ[:, None], recorded, fresh)
        replayed = _replayed_weights(module, logits, index, weights)
        return logits, torch.where(differ[:, None], replayed, weights), index

    with _on_routers(gates, replay):
        yield stats
