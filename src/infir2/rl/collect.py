"""Collect: rollouts from the engine, rewards, dynamic sampling (``rl/loop.py``'s module doc, step 1).

Under torchrun every rank draws the same prompts and seeds, generates and grades its ``share`` of a
round's prompts, and the groups of all ranks are all-gathered in prompt order, so every rank holds the
same buffer and batch: those one process would hold.
"""

from __future__ import annotations

from typing import cast

import torch

from ..generation import Sample, derive_seeds
from ..harness.distributed import all_gather_objects
from ..tasks import reward
from .algorithm import overlong_penalty
from .batch import Group
from .state import Run

__all__ = ["collect_groups", "completion_text", "share"]


def share(k: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank's contiguous share of ``k`` items (the first ``k % world_size`` ranks get one more)."""
    base, extra = divmod(k, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def collect_groups(run: Run) -> tuple[list[Group], dict[str, float]]:
    """The groups this step trains on (see the module doc, 1.) and the statistics of every sampled group.

    Under torchrun every rank draws the same prompts and seeds, generates and grades its share of the
    round's prompts (``share``), and the groups of all ranks are gathered in prompt order: every rank
    then holds the same buffer and batch, those one process would hold.
    """
    r, env, buffer = run.cfg.rollout, run.env, run.data.buffer
    sampled: list[Group] = []
    rounds = 0
    while len(buffer) < r.prompts_per_step and rounds < r.max_rounds:
        indices = run.data.stream.take(r.oversample_prompts or r.prompts_per_step)
        seed = int(torch.randint(0, 2**62, (1,), generator=run.data.sampler))
        seeds = derive_seeds(seed, len(indices))
        lo, hi = share(len(indices), env.rank, env.world_size)
        groups = run.engine.generate([run.prompt_ids[i] for i in indices[lo:hi]], r.group_size, seeds[lo:hi])
        mine = [_grade(run, i, group) for i, group in zip(indices[lo:hi], groups, strict=True)]
        rounds += 1
        for part in cast(list[list[Group]], all_gather_objects(mine, env)):  # in prompt order
            sampled += part
            buffer += [g for g in part if g.kept]
    batch = buffer[: r.prompts_per_step]
    buffer[:] = buffer[r.prompts_per_step :] if r.carry_over else []
    return batch, _collect_stats(sampled or batch, sampled, rounds, len(batch))


def _collect_stats(pool: list[Group], sampled: list[Group], rounds: int, trained: int) -> dict[str, float]:
    """Statistics of ``pool`` (what was sampled; the buffer alone when it served the step)."""
    lengths = [x for g in pool for x in g.lengths]
    rewards = torch.tensor([x for g in pool for x in g.rewards], dtype=torch.float64)
    filtered = sum(not g.kept for g in sampled)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "accuracy": sum(x for g in pool for x in g.correct) / len(lengths),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": max(lengths),
        "truncated_frac": sum(not f for g in pool for f in g.finished) / len(lengths),
        "filtered_frac": filtered / len(sampled) if sampled else 0.0,
        "rounds": rounds,
        "groups_trained": trained,
        "samples": sum(len(g.lengths) for g in sampled),
    }


def _grade(run: Run, index: int, rollouts: list[Sample]) -> Group:
    """Prompt ``index``'s rollouts as a group (rewards graded and shaped); a group that dynamic sampling
    drops keeps only what the statistics need (no responses, no log-probabilities)."""
    r, a = run.cfg.rollout, run.cfg.algo
    texts = [completion_text(run, g.response_ids) for g in rollouts]
    correct = [reward(a.reward, run.problems[index], t) for t in texts]
    lengths = [len(g.response_ids) for g in rollouts]
    shaped = torch.tensor(correct, dtype=torch.float64)
    if a.overlong == "penalty":
        penalty = overlong_penalty(
            torch.tensor(lengths), r.max_new_tokens, a.overlong_buffer, a.overlong_penalty
        )
        shaped = shaped + penalty
    group = Group(index, lengths, [g.finished for g in rollouts], correct, shaped.tolist())
    if a.dynamic_sampling and bool((shaped == shaped[0]).all()):
        return group
    group.responses = [g.response_ids for g in rollouts]
    group.logprobs = torch.zeros(len(rollouts), max(lengths, default=0))
    for j, g in enumerate(rollouts):
        group.logprobs[j, : len(g.logprobs)] = torch.tensor(g.logprobs, dtype=torch.float32)
    routes = [g.routes for g in rollouts]  # routing replay: the engine's experts per token (MoE only)
    group.routes = None if any(r is None for r in routes) else cast(list[torch.Tensor], routes)
    return group


def completion_text(run: Run, response_ids: list[int]) -> str:
    ids = response_ids[:-1] if response_ids and response_ids[-1] in run.stop_ids else response_ids
    return run.tokenizer.decode(ids, skip_special_tokens=False)
