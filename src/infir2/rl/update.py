"""Score and update: the trainer's log-probabilities of a step's ``RLBatch``, then the policy's AdamW steps.

``score`` computes, before any update, the trainer's (``old``) and the reference's log-probabilities of
every response token, the TIS weights and the mismatch metrics against the engine's; ``update`` runs
``algo.updates_per_batch`` mini-batches of the token-level clipped objective (``algorithm.policy_loss``).
``plan_batches`` and ``my_micro_batches`` say which rows go into which forward on which data replica: the
same plan on every rank and for any world size (``rl/loop.py``'s module doc). Under ``parallel.context``
the ranks of a replica share each forward, every row split along the sequence (``rl/context.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..data.base import left_pad_positions
from ..harness.distributed import all_reduce_max, all_reduce_sum
from ..harness.step import apply_update, loss_scale, rounding_noise
from ..loss import score_tokens
from ..model import autocast, replay_routes
from .algorithm import mismatch_from_sums, mismatch_sums, policy_loss, tis_weights
from .batch import RLBatch, Rows
from .config import tis_mode
from .context import RowShard, row_routes, row_shard, shard_response_logprobs
from .state import Run

__all__ = ["Plan", "my_micro_batches", "plan_batches", "response_logprobs", "score", "update"]


def response_logprobs(
    model: nn.Module,
    rows: Rows,
    temperature: float,
    precision: str,
    entropy: bool = False,
    shard: RowShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, R]`` log-probabilities (and entropies) of each response token of ``rows`` at ``temperature``
    given what precedes, laid out as the engine generates (prompt left-padded, response right-padded,
    positions from the first real token): the loss layer's token scorer (``loss.score_tokens``), chunked
    over the response tokens when their fp32 logits would exceed its budget. fp32 (the batch's dtype), also
    for an fp64 model (scored in fp64, then rounded). ``shard``: this rank's part of ``rows`` under
    context parallelism (``rl.context.row_shard``); the same ``[B, R]`` result on every context rank."""
    device = next(model.parameters()).device
    if shard is not None:
        with autocast(precision, device):
            logp, ent = shard_response_logprobs(
                model, shard, rows.response_mask.shape[1], temperature, entropy
            )
        return logp.float(), None if ent is None else ent.float()
    ids, mask = rows.ids.to(device), rows.attention_mask.to(device)
    r = rows.response_mask.shape[1]
    positions = left_pad_positions(mask)
    with autocast(precision, device):
        logp, ent = score_tokens(
            model,
            ids,
            ids[:, -r:],
            r,
            attention_mask=mask,
            position_ids=positions,
            temperature=temperature,
            entropy=entropy,
        )
    return logp.float(), None if ent is None else ent.float()


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def plan_batches(samples: list[Any], updates_per_batch: int, micro_batch_size: int) -> list[list[list[Any]]]:
    """The rollout batch as ``updates_per_batch`` mini-batches (one AdamW step each) of micro-batches of
    ``micro_batch_size`` samples (one forward each): the same on every rank and for any world size."""
    per = math.ceil(len(samples) / updates_per_batch)
    return [_chunks(mini, micro_batch_size) for mini in _chunks(samples, per)]


def my_micro_batches(micros: list[list[Any]], rank: int, world_size: int) -> list[list[Any] | None]:
    """Rank's micro-batches of a mini-batch (micro-batch k on rank ``k % world_size``), padded with None
    to the same count on every rank: FSDP2's collectives need the same number of forwards (and backwards)
    on every rank, so a rank runs a None as a forward of zero weight."""
    own: list[list[Any] | None] = list(micros[rank::world_size])
    return own + [None] * (-(-len(micros) // world_size) - len(own))


Plan = list[list[list[int]]]


@torch.no_grad()
def score(run: Run, batch: RLBatch, plan: Plan) -> dict[str, float]:
    """The trainer's ``old`` logprobs (and the reference's) of this rank's rows, their TIS weights, and
    the mismatch metrics and entropy over all ranks' rows."""
    cfg, env, context = run.cfg, run.env, run.context
    temperature, precision = cfg.rollout.temperature, cfg.model.precision
    old_all, roll_all, ent_sum, routed = [], [], 0.0, None
    for mini in plan:
        for micro in my_micro_batches(mini, context.data_env.rank, context.data_env.world_size):
            rows = batch.rows(micro or mini[0])
            with row_shard(rows, context) as part:
                routes = row_routes(rows, part)  # routing replay: the rollout's experts (else None)
                with replay_routes(run.model, routes) as seen:
                    logp, ent = response_logprobs(run.model, rows, temperature, precision, True, part)
                if run.ref is not None and micro is not None:
                    with replay_routes(run.ref, routes, count=False):
                        ref = response_logprobs(run.ref, rows, temperature, precision, shard=part)[0]
            if routes is not None:  # every rank, the padding forward too: the all-reduce below
                routed = seen.counts * (micro is not None) + (0 if routed is None else routed)
            if micro is None:  # the padding forward: same collectives, nothing kept
                continue
            mask = rows.response_mask.to(logp.device)
            assert ent is not None
            real = mask.bool()
            old = logp.masked_fill(~real, 0).cpu()
            batch.old_logp[rows.index, : old.shape[1]] = old
            if run.ref is not None:
                batch.ref_logp[rows.index, : old.shape[1]] = ref.masked_fill(~real, 0).cpu()
            tis = tis_weights(old, rows.rollout_logp, tis_mode(cfg), cfg.algo.tis_cap)
            batch.tis[rows.index, : old.shape[1]] = tis.masked_fill(~real.cpu(), 0)
            if context.context_rank == 0:  # counted once: the group's other ranks hold the same rows
                ent_sum += float((ent * mask).sum())
                old_all.append(old[real.cpu()])
                roll_all.append(rows.rollout_logp[real.cpu()])
    empty = torch.zeros(0)
    old, roll = (torch.cat(old_all), torch.cat(roll_all)) if old_all else (empty, empty)
    sums, max_abs = mismatch_sums(old, roll, torch.ones_like(old), cfg.algo.tis_cap)
    sums = torch.cat([sums, torch.tensor([ent_sum], dtype=torch.float64)])
    sums = all_reduce_sum(sums.to(env.device), env).cpu()  # NCCL reduces device tensors only
    max_abs = all_reduce_max(max_abs.reshape(1).to(env.device), env).cpu()[0]
    tokens = int(batch.response_len.sum())
    out = mismatch_from_sums(sums[:-1], max_abs)
    out["entropy"] = float(sums[-1]) / max(tokens, 1)
    out["response_tokens"] = tokens
    return out | _routing_metrics(routed, run)


def _routing_metrics(counts: torch.Tensor | None, run: Run) -> dict[str, float]:
    """Routing replay: per MoE layer, the share of the rollout's tokens whose experts the trainer's ``old``
    forward would have chosen differently before replay (``routing/differ_share/layer{i}``), and over all
    layers (``routing/differ_share``); {} without replay or for a dense model."""
    if counts is None:
        return {}
    counts = all_reduce_sum(counts.to(run.env.device), run.env).cpu()  # [layers, 2]: compared, differed
    out = {
        f"routing/differ_share/layer{i}": int(d) / max(int(n), 1) for i, (n, d) in enumerate(counts.tolist())
    }
    out["routing/differ_share"] = int(counts[:, 1].sum()) / max(int(counts[:, 0].sum()), 1)
    return out


def _micro_loss(run: Run, rows: Rows, micro: list[int] | None, part: RowShard | None) -> tuple[Any, Any]:
    """The summed token loss and statistics of ``rows``, the rows of ``micro`` (None: a forward of zero
    weight); ``part``: this rank's shard of them under context parallelism."""
    cfg, a = run.cfg, run.cfg.algo
    logp, _ = response_logprobs(run.model, rows, cfg.rollout.temperature, cfg.model.precision, shard=part)
    dev = logp.device
    mask = rows.response_mask.to(dev) * (rows.keep.float() * float(micro is not None)).to(dev)[:, None]
    old = rows.old_logp.to(dev) if micro else logp.detach()
    tis = rows.tis.to(dev) if micro else None
    ref = rows.ref_logp.to(dev) if run.ref is not None and micro is not None else None
    adv = rows.adv.to(device=dev, dtype=logp.dtype)
    return policy_loss(logp, old, adv, mask, a.clip_low, a.clip_high, tis, a.kl_coef, ref)


def update(run: Run, batch: RLBatch, plan: Plan, seed: int | None) -> dict[str, float]:
    """One AdamW step per mini-batch of ``plan``; each rank backpropagates its micro-batches of it.

    The token-level loss is normalised by the token count of the whole mini-batch (all ranks), and
    scaled by the world size because FSDP2 averages the gradients over ranks (``harness.step.loss_scale``):
    the gradient is the one process's (context ranks: partial sums of one loss's, ``rl/context.py``).
    Loss and statistics are summed over ranks, each row counted once (on context rank 0 of its group).
    ``seed`` (the step's, ``harness.step.step_seed``): micro-batch k of mini-batch j rounds
    stochastically (``nvfp4``) with draws seeded by (seed, j, k, context rank) wherever it runs
    (``harness.step.rounding_noise``); the tail (clip, the step when finite, gradients freed) is the
    harness's ``apply_update``.
    """
    cfg, env, context = run.cfg, run.env, run.context
    data, counted = context.data_env, context.context_rank == 0
    sums = torch.zeros(4, dtype=torch.float64)  # clip_low, clip_high, kl, tokens
    losses, norms, skipped = [], [], 0
    for j, mini in enumerate(plan):
        flat = torch.tensor([i for micro in mini for i in micro])
        n_tokens = int(batch.response_len[flat][batch.keep[flat]].sum())
        scale = loss_scale(env.world_size, n_tokens)
        local = torch.zeros(5, dtype=torch.float64)  # the summed token loss, then the four sums above
        for i, micro in enumerate(my_micro_batches(mini, data.rank, data.world_size)):
            rows = batch.rows(micro or mini[0])
            at = data.rank + i * data.world_size  # its index in the mini-batch (past the end: padding)
            noise = rounding_noise(seed, j, at, context.context_rank, device=env.device)
            with (
                row_shard(rows, context) as part,  # the backward too: it may recompute attention
                replay_routes(run.model, row_routes(rows, part), count=False),  # and the routing
                noise,
            ):
                total, st = _micro_loss(run, rows, micro, part)
                (total * scale).backward()
            stats = [float(total.detach())] + [
                float(st[k]) for k in ("clip_low", "clip_high", "kl", "tokens")
            ]
            if counted:  # once per row: the group's other ranks computed the same numbers
                local += torch.tensor(stats, dtype=torch.float64)
        local = all_reduce_sum(local.to(env.device), env).cpu()
        sums += local[1:]
        loss = float(local[0]) / max(n_tokens, 1)
        done = apply_update(run.model, run.optimizer, loss, cfg.optim.lr, cfg.optim.grad_clip, n_tokens == 0)
        losses.append(loss)
        norms.append(done.grad_norm)
        skipped += not done.finite
    clip_low, clip_high, kl, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    out = {
        "loss": sum(losses) / max(len(losses), 1),
        "grad_norm": max(norms) if norms else 0.0,
        "lr": cfg.optim.lr,
        "clip_low_frac": clip_low / tokens,
        "clip_high_frac": clip_high / tokens,
        "updates": len(norms),
        "skipped_updates": skipped,
    }
    if run.ref is not None:  # k3 KL to the start model (algo.kl_coef > 0 or guard.max_kl keep one)
        out["kl_ref"] = kl / tokens
    return out
