"""The RL loop: ``rl(config) -> RLResult``. One step, top to bottom (``_step``):

1. **collect** (``collect_groups``): draw ``rollout.oversample_prompts`` prompts, generate
   ``rollout.group_size`` responses each with the rollout engine (seeded from the run's sampler), grade
   them (``algo.reward``), shape the reward (``algo.overlong: penalty``), and keep the groups whose
   rewards do not all agree (dynamic sampling); repeat until ``rollout.prompts_per_step`` groups are
   kept or ``rollout.max_rounds`` rounds are done. Kept groups beyond the step's need are dropped, or
   with ``rollout.carry_over`` buffered for the next step (the buffer is part of every checkpoint);
2. **score** (``_score``): the trainer's log-probabilities of every response token before any update
   (``old``), the mismatch metrics against the engine's (``algorithm.mismatch_sums``), the TIS
   weights (``algorithm.tis_weights``, mode ``tis_mode(cfg)``) and group advantages;
3. **update**: ``algo.updates_per_batch`` mini-batches, each one AdamW step at the constant
   ``optim.lr`` on the token-level clipped objective (``algorithm.policy_loss``), gradients clipped;
   a non-finite loss or norm skips the update (``train.max_nonfinite_in_row`` in a row stop the run);
4. **sync**: the engine takes the new weights (``RolloutEngine.load_weights``: for FP8 rollouts, the
   128x128 quantization of the export).

Around it, the conventions of ``infir2 train``: the run folder ``<out_dir>/<name>`` with ``config.yaml``,
``metrics.jsonl`` (every step), ``tensorboard/``, a progress bar, checkpoints (``checkpoint.save_checkpoint``:
atomic, checksummed; a damaged one is skipped for the next older one) and ``hf/`` at the end. A rerun
resumes from the newest checkpoint and continues bit for bit (model, AdamW, prompt order, sampler
and global RNG, dynamic-sampling buffer).

Under ``torchrun --nproc_per_node N`` (every rank calls ``rl``) the policy is sharded with FSDP2 as in
``infir2 train`` (``train.distributed.shard_model``); each rank keeps a whole rollout engine (and
reference). What is split and what is gathered:

* **collect**: every rank draws the same prompts and the same seed per round; rank r generates and grades
  its contiguous ``share`` of the round's prompts, each prompt with its own seed (``engine.derive_seeds``:
  a group does not depend on which rank or batch generated it); the records are all-gathered in prompt
  order, so every rank holds the same kept groups, buffer and batch -- those of one process;
* **score / update**: the batch's mini-batches and micro-batches are one process's (``plan_batches``);
  micro-batch k of a mini-batch runs on rank ``k % N`` (``my_micro_batches``; a rank with one fewer runs
  a forward of zero weight, so FSDP2's collectives match). The loss is normalised by the whole
  mini-batch's tokens and multiplied by N (FSDP2 averages gradients); statistics are all-reduced;
* **sync**: every rank's engine all-gathers the whole weights (``BuiltinEngine.load_weights``);
* **validation**: each rank scores its share of the held-out problems; the counts are all-reduced;
* **checkpoint / export**: full state dicts gathered to rank 0, which writes them. Prompt position,
  sampler, buffer and RNG are the same on every rank, so a checkpoint resumes on any number of processes.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from .. import checkpoint as ckpt
from ..data import load_tokenizer
from ..data.chat import render_prompt, stop_token_ids
from ..eval.tasks import Problem, load_problems
from ..export import export_model
from ..fp8 import get_recipe
from ..model import autocast, build_from_config, check_model_folder, load_pretrained, prepare_for_training
from ..train.config_changes import config_changes
from ..train.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    init_distributed,
    shard_model,
)
from ..train.lock import run_lock
from ..train.metrics import MetricsLogger, peak_memory_gib
from ..train.optim import build_optimizer
from ..train.typed_yaml import to_plain
from .algorithm import (
    group_advantages,
    mismatch_from_sums,
    mismatch_sums,
    overlong_penalty,
    policy_loss,
    tis_weights,
)
from .config import RLConfig, save_rl_config, tis_mode
from .engine import BuiltinEngine, Rollout, RolloutEngine, derive_seeds
from .prompts import PromptStream
from .rewards import REWARDS

__all__ = [
    "RLResult",
    "RLState",
    "collect_groups",
    "my_micro_batches",
    "plan_batches",
    "rl",
    "sequence_logprobs",
    "share",
]

log = logging.getLogger(__name__)


@dataclass
class RLState:
    """The loop's counters; saved under ``train_state`` in every checkpoint."""

    step: int = 0
    updates: int = 0  # optimizer steps done (skipped ones included)
    samples_seen: int = 0
    nonfinite_total: int = 0
    nonfinite_in_row: int = 0


@dataclass
class RLResult:
    run_dir: Path
    step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None
    hf_dir: Path | None = None
    resumed_from: Path | None = None


@dataclass
class Run:
    """What a step works with (built once by ``_setup``)."""

    cfg: RLConfig
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    engine: RolloutEngine
    problems: list[Problem]
    prompt_ids: list[list[int]]
    stream: PromptStream
    sampler: torch.Generator
    buffer: list[dict[str, Any]]
    ref: nn.Module | None
    stop_ids: list[int]
    pad_id: int
    val: list[Problem]
    val_ids: list[list[int]]


# --------------------------------------------------------------------------------------------
# Trainer-side log-probabilities


def sequence_logprobs(
    model: nn.Module,
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    pad_id: int,
    temperature: float,
    precision: str,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` of each response token given its prompt: ``[B, R]`` logp, mask, entropy.

    Sequences are laid out as the engine generates them (prompt left-padded, response right-padded,
    positions counted from the first real token); only the response positions' logits are computed.
    """
    device = next(model.parameters()).device
    width, r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), width + r), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp_mask = torch.zeros((len(prompts), r))
    for i, (p, y) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, width - len(p) : width + len(y)] = torch.tensor(p + y)
        mask[i, width - len(p) : width + len(y)] = 1
        resp_mask[i, : len(y)] = 1
    ids, mask, resp_mask = ids.to(device), mask.to(device), resp_mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with autocast(precision, device):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=r + 1
        ).logits
    logp_all = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, R, V]
    logp = logp_all.gather(-1, ids[:, width:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1).detach() if entropy else None
    return logp, resp_mask, ent


# --------------------------------------------------------------------------------------------
# Collect: rollouts, rewards, dynamic sampling


def share(k: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank's contiguous share of ``k`` items (the first ``k % world_size`` ranks get one more)."""
    base, extra = divmod(k, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def collect_groups(run: Run) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The groups this step trains on (see the module doc, 1.) and the statistics of every sampled group.

    Under torchrun every rank draws the same prompts and seeds, generates and grades its share of the
    round's prompts (``share``), and the kept groups of all ranks are gathered in prompt order: every
    rank then holds the same buffer and batch, those one process would hold.
    """
    r, env = run.cfg.rollout, run.env
    sampled: list[dict[str, Any]] = []
    filtered = rounds = 0
    while len(run.buffer) < r.prompts_per_step and rounds < r.max_rounds:
        indices = run.stream.take(r.oversample_prompts or r.prompts_per_step)
        seeds = derive_seeds(int(torch.randint(0, 2**62, (1,), generator=run.sampler)), len(indices))
        lo, hi = share(len(indices), env.rank, env.world_size)
        groups = run.engine.generate([run.prompt_ids[i] for i in indices[lo:hi]], r.group_size, seeds[lo:hi])
        mine = [_grade(run, i, group) for i, group in zip(indices[lo:hi], groups, strict=True)]
        rounds += 1
        gathered = cast(list[list[tuple[dict[str, Any], bool]]], all_gather_objects(mine, env))
        for part in gathered:  # in prompt order: rank 0's share first
            for record, keep in part:
                sampled.append(record)
                if keep:
                    run.buffer.append(record)
                else:
                    filtered += 1
    batch = run.buffer[: r.prompts_per_step]
    run.buffer[:] = run.buffer[r.prompts_per_step :] if r.carry_over else []
    pool = sampled or batch  # the buffer alone served this step (carry_over): describe what is trained on
    lengths = [x for g in pool for x in g["lengths"]]
    rewards = torch.tensor([x for g in pool for x in g["rewards"]], dtype=torch.float64)
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "accuracy": sum(x for g in pool for x in g["correct"]) / len(lengths),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": max(lengths),
        "truncated_frac": sum(not f for g in pool for f in g["finished"]) / len(lengths),
        "filtered_frac": filtered / len(sampled) if sampled else 0.0,
        "rounds": rounds,
        "groups_trained": len(batch),
        "samples": sum(len(g["lengths"]) for g in sampled),
    }
    return batch, stats


def _grade(run: Run, index: int, group: list[Rollout]) -> tuple[dict[str, Any], bool]:
    """Prompt ``index``'s group as a record (rewards graded and shaped), and whether dynamic sampling keeps
    it; a dropped group's record keeps only what the statistics need (no responses, no log-probabilities)."""
    r, a = run.cfg.rollout, run.cfg.algo
    texts = [_completion_text(run, g.response_ids) for g in group]
    correct = [REWARDS[a.reward](t, run.problems[index].answer) for t in texts]
    lengths = [len(g.response_ids) for g in group]
    shaped = torch.tensor(correct, dtype=torch.float64)
    if a.overlong == "penalty":
        shaped = shaped + overlong_penalty(
            torch.tensor(lengths), r.max_new_tokens, a.overlong_buffer, a.overlong_penalty
        )
    record = {
        "prompt": index,
        "lengths": lengths,
        "finished": [g.finished for g in group],
        "correct": correct,
        "rewards": shaped.tolist(),
    }
    if a.dynamic_sampling and bool((shaped == shaped[0]).all()):
        return record, False
    return {
        **record,
        "responses": [g.response_ids for g in group],
        "logprobs": [g.logprobs for g in group],
    }, True


def _completion_text(run: Run, response_ids: list[int]) -> str:
    ids = response_ids[:-1] if response_ids and response_ids[-1] in run.stop_ids else response_ids
    return run.tokenizer.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------------------------
# Score and update


def _samples(run: Run, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per response: prompt ids, response ids, engine logprobs, advantage, counts-in-loss."""
    if not batch:
        return []
    adv = group_advantages(
        torch.tensor([g["rewards"] for g in batch], dtype=torch.float64), run.cfg.algo.adv_eps
    )
    out = []
    for gi, g in enumerate(batch):
        for j, resp in enumerate(g["responses"]):
            keep = not (run.cfg.algo.overlong == "mask" and not g["finished"][j])
            out.append(
                {
                    "prompt": run.prompt_ids[g["prompt"]],
                    "response": resp,
                    "rollout_logp": g["logprobs"][j],
                    "adv": float(adv[gi, j]),
                    "keep": keep,
                }
            )
    return out


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


def _logprobs(run: Run, model: nn.Module, micro: list[dict[str, Any]], entropy: bool = False) -> Any:
    cfg = run.cfg
    return sequence_logprobs(
        model,
        [s["prompt"] for s in micro],
        [s["response"] for s in micro],
        run.pad_id,
        cfg.rollout.temperature,
        cfg.model.precision,
        entropy=entropy,
    )


@torch.no_grad()
def _score(run: Run, plan: list[list[list[dict[str, Any]]]]) -> dict[str, float]:
    """The trainer's ``old`` logprobs (and the reference's) of this rank's samples, their TIS weights, and
    the mismatch metrics and entropy over all ranks' samples."""
    cfg, env = run.cfg, run.env
    old_all, roll_all, ent_sum = [], [], 0.0
    for mini in plan:
        for micro in my_micro_batches(mini, env.rank, env.world_size):
            logp, mask, ent = _logprobs(run, run.model, micro or mini[0], entropy=True)
            if micro is None:  # the padding forward: same collectives, nothing kept
                continue
            ref = _logprobs(run, run.ref, micro)[0] if run.ref is not None else None
            assert ent is not None
            ent_sum += float((ent * mask).sum())
            for i, s in enumerate(micro):
                n = len(s["response"])
                s["old_logp"] = logp[i, :n].cpu()
                s["ref_logp"] = ref[i, :n].cpu() if ref is not None else None
                roll = torch.tensor(s["rollout_logp"], dtype=torch.float32)
                s["tis"] = tis_weights(s["old_logp"], roll, tis_mode(cfg), cfg.algo.tis_cap)
                old_all.append(s["old_logp"])
                roll_all.append(roll)
    empty = torch.zeros(0)
    old, roll = (torch.cat(old_all), torch.cat(roll_all)) if old_all else (empty, empty)
    sums, max_abs = mismatch_sums(old, roll, torch.ones_like(old), cfg.algo.tis_cap)
    sums = torch.cat([sums, torch.tensor([ent_sum], dtype=torch.float64)])
    sums = all_reduce_sum(sums.to(env.device), env).cpu()  # NCCL reduces device tensors only
    max_abs = all_reduce_max(max_abs.reshape(1).to(env.device), env).cpu()[0]
    tokens = sum(len(s["response"]) for mini in plan for micro in mini for s in micro)
    out = mismatch_from_sums(sums[:-1], max_abs)
    out["entropy"] = float(sums[-1]) / max(tokens, 1)
    out["response_tokens"] = tokens
    return out


def _pad_stack(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([F.pad(t, (0, width - t.numel())) for t in rows])


def _grad_norm(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the norm over all shards
        norm = norm.full_tensor()
    return float(norm)


def _update(run: Run, plan: list[list[list[dict[str, Any]]]]) -> dict[str, float]:
    """One AdamW step per mini-batch of ``plan``; each rank backpropagates its micro-batches of it.

    The token-level loss is normalised by the token count of the whole mini-batch (all ranks), and
    scaled by the world size because FSDP2 averages the gradients over ranks: the gradient is the one
    process's. Loss and statistics are summed over ranks.
    """
    cfg, a, env = run.cfg, run.cfg.algo, run.env
    sums = torch.zeros(4, dtype=torch.float64)  # clip_low, clip_high, kl, tokens
    losses, norms, skipped = [], [], 0
    for mini in plan:
        n_tokens = sum(len(s["response"]) for micro in mini for s in micro if s["keep"])
        scale = env.world_size / max(n_tokens, 1)
        local = torch.zeros(5, dtype=torch.float64)  # the summed token loss, then the four sums above
        for micro in my_micro_batches(mini, env.rank, env.world_size):
            rows = micro or mini[0]  # None: a forward and backward of zero weight (the same collectives)
            logp, mask, _ = _logprobs(run, run.model, rows)
            width = logp.shape[1]
            dev = logp.device
            keep = torch.tensor([float(s["keep"] and micro is not None) for s in rows], device=dev)[:, None]
            old = _pad_stack([s["old_logp"] for s in rows], width).to(dev) if micro else logp.detach()
            tis = _pad_stack([s["tis"] for s in rows], width).to(dev) if micro else None
            ref = None
            if run.ref is not None and micro is not None:
                ref = _pad_stack([s["ref_logp"] for s in rows], width).to(dev)
            adv = torch.tensor([s["adv"] for s in rows], device=dev, dtype=logp.dtype)
            total, st = policy_loss(logp, old, adv, mask * keep, a.clip_low, a.clip_high, tis, a.kl_coef, ref)
            (total * scale).backward()
            local += torch.tensor(
                [float(total.detach())] + [float(st[k]) for k in ("clip_low", "clip_high", "kl", "tokens")],
                dtype=torch.float64,
            )
        local = all_reduce_sum(local.to(env.device), env).cpu()
        sums += local[1:]
        norm = _grad_norm(run.model, cfg.optim.grad_clip)
        loss = float(local[0]) / max(n_tokens, 1)
        losses.append(loss)
        norms.append(norm)
        if math.isfinite(loss) and math.isfinite(norm) and n_tokens > 0:
            for group in run.optimizer.param_groups:
                group["lr"] = cfg.optim.lr
            run.optimizer.step()
        elif not (math.isfinite(loss) and math.isfinite(norm)):
            skipped += 1
        run.optimizer.zero_grad(set_to_none=True)
    clip_low, clip_high, kl, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    return {
        "loss": sum(losses) / max(len(losses), 1),
        "grad_norm": max(norms) if norms else 0.0,
        "lr": cfg.optim.lr,
        "clip_low_frac": clip_low / tokens,
        "clip_high_frac": clip_high / tokens,
        "kl_ref": kl / tokens,
        "updates": len(norms),
        "skipped_updates": skipped,
    }


def _evaluate(run: Run) -> float:
    """Greedy accuracy on the held-out problems with the engine's current weights (each rank its share)."""
    reward = REWARDS[run.cfg.algo.reward]
    lo, hi = share(len(run.val), run.env.rank, run.env.world_size)
    groups = run.engine.generate(run.val_ids[lo:hi], 1, seed=0, greedy=True)
    scores = [
        reward(_completion_text(run, g[0].response_ids), p.answer)
        for g, p in zip(groups, run.val[lo:hi], strict=True)
    ]
    correct = torch.tensor([sum(scores)], dtype=torch.float64, device=run.env.device)
    return float(all_reduce_sum(correct, run.env)[0]) / len(run.val)


# --------------------------------------------------------------------------------------------
# Checkpoints


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _save(run: Run, state: RLState) -> Path:
    """A full checkpoint, gathered and written by rank 0 (every rank calls this). The prompt position,
    sampler, buffer and RNG are the same on every rank (``collect_groups``), so rank 0's stand for all."""
    model_sd, optim_sd = get_state_dict(
        run.model, run.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    full = {
        "model": model_sd,
        "optimizer": optim_sd,
        "scheduler": {"step": state.step},
        "data": {
            "prompts": run.stream.state_dict(),
            "buffer": run.buffer,
            "sampler": run.sampler.get_state(),
        },
        "train_state": {
            **vars(state),
            "world_size": run.env.world_size,
            "rng": _rng_state(),
            "config": to_plain(run.cfg),
        },
    }
    path = None
    if run.env.is_main:
        path = ckpt.save_checkpoint(
            run.cfg.run_dir / "checkpoints", state.step, full, keep_last=run.cfg.train.keep_last
        )
    return broadcast_object(path, run.env)  # type: ignore[return-value]


#: config keys (or section prefixes) whose change on resume alters what the run computes
MEANINGFUL = ("optim.", "data.", "model.", "fp8.", "rollout.", "algo.", "run.seed")


def _check_config_changes(cfg: RLConfig, saved: dict[str, Any], step: int, main: bool = True) -> None:
    """Refuse a resume whose config changes the run's meaning (unless accepted); keep the old config.yaml."""
    meaningful, harmless = config_changes(saved, to_plain(cfg))
    changes = meaningful + harmless
    refused = [c for c in changes if any(c.startswith(m) for m in MEANINGFUL)]
    if refused and not cfg.train.accept_config_changes:
        raise ValueError(
            f"{cfg.run_dir}: resuming at step {step} with a config that changes the run: "
            f"{'; '.join(refused)}. Use another run.name, restore the config, or pass "
            "--accept-config-changes"
        )
    if changes and main:
        log.info("resuming with config changes: %s", "; ".join(changes))
        old = cfg.run_dir / "config.yaml"
        if old.is_file():
            old.replace(cfg.run_dir / f"config.{step}.yaml")


def _restore(run: Run) -> tuple[RLState, Path | None]:
    found = ckpt.load_latest_valid(run.cfg.run_dir / "checkpoints")
    if found is None:
        return RLState(), None
    path, full = found
    _check_config_changes(
        run.cfg, full["train_state"]["config"], int(full["train_state"]["step"]), run.env.is_main
    )
    set_state_dict(
        run.model,
        run.optimizer,
        model_state_dict=full["model"],
        optim_state_dict=full["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    run.stream.load_state_dict(full["data"]["prompts"])
    run.buffer[:] = full["data"]["buffer"]
    for g in run.buffer:  # a buffer saved before records carried their lengths
        g.setdefault("lengths", [len(y) for y in g["responses"]])
    run.sampler.set_state(full["data"]["sampler"])
    saved = full["train_state"]
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    state = RLState(**{k: saved[k] for k in vars(RLState())})
    log.info(
        "resumed from %s at step %d (saved by %d processes, now %d)",
        path,
        state.step,
        saved.get("world_size", 1),
        run.env.world_size,
    )
    return state, path


# --------------------------------------------------------------------------------------------
# The run


def _load_model(cfg: RLConfig, tokenizer: Any) -> nn.Module:
    if cfg.model.path:
        check_model_folder(cfg.model.path)
        return load_pretrained(cfg.model.path)
    if cfg.model.from_config:
        return build_from_config(cfg.model.from_config, vocab_size=len(tokenizer), seed=cfg.run.seed)
    raise ValueError(
        "model: give model.path (a local HF folder, e.g. the SFT run's <run>/hf) or model.from_config"
    )


def _encode(tokenizer: Any, problems: list[Problem]) -> list[list[int]]:
    return [
        tokenizer(render_prompt(tokenizer, p.user_message), add_special_tokens=False)["input_ids"]
        for p in problems
    ]


def _setup(cfg: RLConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any) -> Run:
    if not cfg.data.prompts_path:
        raise ValueError('data.prompts_path: is required (a JSONL file of {"problem", "answer"} lines)')
    problems = load_problems(cfg.data.prompts_path, "math")
    val = load_problems(cfg.data.val_path, "math")[: cfg.train.eval_problems] if cfg.data.val_path else []
    tokenizer_path = cfg.model.tokenizer or cfg.model.path
    if tokenizer is None:
        if not tokenizer_path:
            raise ValueError("model.tokenizer: a model built from_config needs a tokenizer folder")
        tokenizer = load_tokenizer(tokenizer_path)
    model = model if model is not None else _load_model(cfg, tokenizer)
    model = prepare_for_training(
        model, cfg.fp8.recipe, cfg.fp8.backend, cfg.model.activation_checkpointing, cfg.model.recompute_mlp
    ).to(env.device)
    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    r = cfg.rollout
    engine = BuiltinEngine(
        model,
        r.precision,
        r.scale,
        cfg.model.precision,
        r.temperature,
        r.max_new_tokens,
        r.batch_size,
        stops,
        pad_id,
    )
    ref = None
    if cfg.algo.kl_coef > 0:  # a whole copy on every rank (no collectives in its forwards)
        import copy

        ref = copy.deepcopy(model).eval().requires_grad_(False)
    if env.distributed:  # the engine and the reference copied the whole model above; now shard it
        model = shard_model(
            model, cfg.model.precision, get_recipe(cfg.fp8.recipe).param_gather(cfg.fp8.param_gather)
        )
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.run.seed
    return Run(
        cfg,
        env,
        model,
        build_optimizer(model, cfg.optim),
        tokenizer,
        engine,
        problems,
        _encode(tokenizer, problems),
        PromptStream(len(problems), cfg.data.shuffle, seed),
        torch.Generator().manual_seed(cfg.run.seed),
        [],
        ref,
        stops,
        pad_id,
        val,
        _encode(tokenizer, val),
    )


def rl(
    cfg: RLConfig, *, model: nn.Module | None = None, tokenizer: Any = None, progress: bool = True
) -> RLResult:
    """Run (or resume) the RL run ``cfg`` describes. ``model`` (an unconverted HF causal LM) and
    ``tokenizer`` may be passed in (tests do); otherwise they are loaded from ``cfg.model``. Under
    ``torchrun`` every rank calls this (the module doc says what each rank does)."""
    env = init_distributed(cfg.run.device)
    try:
        with run_lock(cfg.run_dir, enabled=env.is_main):  # one process (group) per run folder
            return _run(cfg, env, model, tokenizer, progress)
    finally:
        env.close()


def _run(cfg: RLConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any, progress: bool) -> RLResult:
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    run = _setup(cfg, env, model, tokenizer)
    state, resumed_from = _restore(run)
    ckpt.check_room_for_saves(cfg.run_dir, run.model, run.optimizer, cfg.train.keep_last)  # disk full: now
    run.engine.load_weights(run.model)
    if env.is_main:
        save_rl_config(cfg, cfg.run_dir / "config.yaml")
    result = RLResult(cfg.run_dir, state.step, resumed_from=resumed_from)
    t = cfg.train
    with MetricsLogger(cfg.run_dir, env.is_main, state.step, t.max_steps, t.log_every, progress) as logger:
        while state.step < t.max_steps:
            metrics = _step(run, state)
            last = state.step == t.max_steps
            if run.val and (last or (t.eval_every and state.step % t.eval_every == 0)):
                metrics["val_accuracy"] = _evaluate(run)
            logger.log(metrics)
            result.history.append(metrics)
            _count_nonfinite(run, state, metrics, logger)
            if t.save_every and state.step % t.save_every == 0 and not last and not state.nonfinite_in_row:
                result.checkpoint = _save(run, state)
        result.step = state.step
        if state.step and not state.nonfinite_in_row:
            result.checkpoint = _save(run, state)
        result.hf_dir = _export(run)
    return result


def _export(run: Run) -> Path | None:
    """``<run>/hf``: the full state dict gathered to rank 0, which writes it (every rank calls this)."""
    cfg = run.cfg
    fmt = cfg.model.export_dtype or cfg.model.precision
    model_sd = get_model_state_dict(
        run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = None
    if run.env.is_main:
        out = export_model(
            run.model,
            run.tokenizer,
            cfg.run_dir / "hf",
            fmt=fmt,
            state_dict=model_sd,  # type: ignore[arg-type]
            overwrite=True,
        )
    return broadcast_object(out, run.env)  # type: ignore[return-value]


def _step(run: Run, state: RLState) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch, stats = collect_groups(run)
    t1 = time.perf_counter()
    samples = _samples(run, batch)
    metrics: dict[str, Any] = {"step": state.step + 1, **stats}
    if samples:  # the same batch on every rank: all take this branch
        plan = plan_batches(samples, run.cfg.algo.updates_per_batch, run.cfg.algo.micro_batch_size)
        metrics |= _score(run, plan)
        metrics |= _update(run, plan)
        run.engine.load_weights(run.model)
    else:
        metrics |= {"loss": 0.0, "grad_norm": 0.0, "lr": run.cfg.optim.lr, "updates": 0, "skipped_updates": 0}
    state.step += 1
    state.updates += metrics["updates"]
    state.samples_seen += int(stats["samples"])
    now = time.perf_counter()
    metrics |= {
        "tis_mode": tis_mode(run.cfg),
        "rollout_time_s": t1 - t0,
        "train_time_s": now - t1,
        "step_time_s": now - t0,
        "samples_seen": state.samples_seen,
        "peak_mem_gib": peak_memory_gib(run.env.device),
    }
    return metrics


def _count_nonfinite(run: Run, state: RLState, metrics: dict[str, Any], logger: MetricsLogger) -> None:
    if not metrics["skipped_updates"]:
        state.nonfinite_in_row = 0
        return
    state.nonfinite_total += 1
    state.nonfinite_in_row += 1
    logger.message(
        f"step {state.step}: non-finite loss or gradient norm, {metrics['skipped_updates']} update(s) "
        f"skipped ({state.nonfinite_in_row} steps in a row)"
    )
    if state.nonfinite_in_row >= run.cfg.train.max_nonfinite_in_row:
        raise ValueError(
            f"stopping at step {state.step}: {state.nonfinite_in_row} steps in a row had a non-finite "
            f"loss or gradient norm (train.max_nonfinite_in_row); lower optim.lr or try another "
            f"fp8.recipe, then rerun (it resumes from the last checkpoint)"
        )
