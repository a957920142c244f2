"""The RL loop: ``rl(config) -> RLResult``. One step, top to bottom (``_step``):

1. **collect** (``collect_groups``): draw ``rollout.oversample_prompts`` prompts, generate
   ``rollout.group_size`` responses each with the rollout engine (seeded from the run's sampler), grade
   them (``algo.reward``), shape the reward (``algo.overlong: penalty``), and keep the groups whose
   rewards do not all agree (dynamic sampling); repeat until ``rollout.prompts_per_step`` groups are
   kept or ``rollout.max_rounds`` rounds are done. Kept groups beyond the step's need are dropped, or
   with ``rollout.carry_over`` buffered for the next step (the buffer is part of every checkpoint);
2. **score** (``_score``): the step's ``RLBatch`` (``rl/batch.py``: padded tensors, built once), the
   trainer's log-probabilities of every response token before any update (``old``), the mismatch
   metrics against the engine's (``algorithm.mismatch_sums``), the TIS weights (``algorithm.tis_weights``,
   mode ``tis_mode(cfg)``) and group advantages; a mismatch above ``train.max_prob_error`` skips the
   step's updates (the engine no longer matches the policy: not a step to learn from);
3. **update**: ``algo.updates_per_batch`` mini-batches, each one AdamW step at the constant
   ``optim.lr`` on the token-level clipped objective (``algorithm.policy_loss``), gradients clipped;
   a non-finite loss or norm skips the update (``train.max_nonfinite_in_row`` skipped steps in a row
   stop the run with ``NonFiniteError``);
4. **sync**: the engine takes the new weights (``RolloutEngine.load_weights``: for FP8 rollouts, the
   128x128 quantization of the export).

Around it, the run harness ``infir2 train`` uses too (``infir2.harness``): the run folder
``<out_dir>/<name>`` (lock, ``config.yaml``, resume refused on meaningful config changes unless
``run.accept_config_changes``), ``metrics.jsonl``, ``tensorboard/``, a progress bar, the model and
tokenizer set-up, checkpoints (atomic, checksummed; a damaged one is skipped for the next older one)
and ``hf/`` at the end. A rerun resumes from the newest checkpoint and continues bit for bit (model,
AdamW, prompt order, sampler, every RNG, the dynamic-sampling buffer).

Under ``torchrun --nproc_per_node N`` (every rank calls ``rl``) the policy is sharded with FSDP2 as in
``infir2 train``; each rank keeps a whole rollout engine (and reference), built before sharding:

* **collect**: every rank draws the same prompts and the same seed per round; rank r generates and grades
  its contiguous ``share`` of the round's prompts, each prompt with its own seed (``generation.derive_seeds``:
  a group does not depend on which rank or batch generated it); the groups are all-gathered in prompt
  order, so every rank holds the same kept groups, buffer and batch -- those of one process;
* **score / update**: the batch's mini-batches and micro-batches are one process's (``plan_batches``);
  micro-batch k of a mini-batch runs on rank ``k % N`` (``my_micro_batches``; a rank with one fewer runs
  a forward of zero weight, so FSDP2's collectives match). The loss is normalised by the whole
  mini-batch's tokens and multiplied by N (FSDP2 averages gradients); statistics are all-reduced;
* **sync**: every rank's engine all-gathers the whole weights (``generation.BuiltinEngine.load_weights``);
* **validation**: each rank scores its share of the held-out problems; the counts are all-reduced;
* **checkpoint / export**: full state dicts gathered to rank 0, which writes them. Prompt position,
  sampler, buffer and RNG are the same on every rank, so a checkpoint resumes on any number of processes.
"""

from __future__ import annotations

import copy
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

from ..data.chat import render_prompt, stop_token_ids
from ..eval.tasks import Problem, load_problems, reward
from ..generation import EngineOptions, RolloutEngine, Sample, SamplingConfig, build_engine, derive_seeds
from ..harness.config import config_to_dict
from ..harness.config_changes import reconcile_saved_config
from ..harness.distributed import DistEnv, all_gather_objects, all_reduce_max, all_reduce_sum
from ..harness.guards import StepGuard, clip_grad_norm
from ..harness.metrics import MetricsLogger, peak_memory_gib
from ..harness.optim import build_optimizer
from ..harness.resume import PendingSave, SavePolicy, export_final, restore, save
from ..harness.run import open_run
from ..harness.setup import check_model_inputs, load_run_tokenizer, setup_model
from ..model import autocast
from .algorithm import (
    group_advantages,
    mismatch_from_sums,
    mismatch_sums,
    overlong_penalty,
    policy_loss,
    tis_weights,
)
from .batch import Group, RLBatch, Rows
from .config import MEANINGFUL, RLConfig, tis_mode
from .prompts import PromptStream

__all__ = [
    "RLResult",
    "RLState",
    "RolloutData",
    "collect_groups",
    "my_micro_batches",
    "plan_batches",
    "rl",
    "sequence_logprobs",
    "share",
]

#: what to try when skipped steps stop an RL run
ADVICE = "Lower optim.lr or try another fp8.recipe, then rerun (it resumes from the last checkpoint)"


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


class RolloutData:
    """The run's data state (``harness.resume.Resumable``): prompt order, sampler, dynamic-sampling buffer.

    The same on every rank (``replicated``): one copy is saved."""

    replicated = True

    def __init__(self, stream: PromptStream, sampler: torch.Generator) -> None:
        self.stream, self.sampler = stream, sampler
        self.buffer: list[Group] = []

    def state_dict(self) -> dict[str, Any]:
        buffer = [g.to_record() for g in self.buffer]
        return {"prompts": self.stream.state_dict(), "buffer": buffer, "sampler": self.sampler.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["prompts"])
        self.buffer[:] = [Group.from_record(r) for r in state["buffer"]]
        self.sampler.set_state(state["sampler"])


@dataclass
class Run:
    """What a step works with (built once by ``_setup``)."""

    cfg: RLConfig
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    engine: RolloutEngine
    ref: nn.Module | None
    problems: list[Problem]
    prompt_ids: list[list[int]]
    data: RolloutData
    stop_ids: list[int]
    pad_id: int
    val: list[Problem]
    val_ids: list[list[int]]

    @property
    def policy(self) -> SavePolicy:
        return SavePolicy(self.cfg.run_dir / "checkpoints", "full", self.cfg.train.keep_last)


# --------------------------------------------------------------------------------------------
# Trainer-side log-probabilities


def _response_logprobs(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    r: int,
    temperature: float,
    precision: str,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` of the last ``r`` tokens of ``ids`` ``[B, P + R]`` given what precedes."""
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with autocast(precision, device):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=r + 1
        ).logits
    logp_all = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, R, V]
    logp = logp_all.gather(-1, ids[:, -r:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1).detach() if entropy else None
    return logp, ent


def sequence_logprobs(
    model: nn.Module,
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    pad_id: int,
    temperature: float,
    precision: str,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``[B, R]`` logp, response mask and entropy of each response token given its prompt, laid out as the
    engine generates (prompt left-padded, response right-padded, positions from the first real token)."""
    groups = [
        Group(i, [len(y)], [True], [0.0], [0.0], [list(y)], torch.zeros(1, len(y)))
        for i, y in enumerate(responses)
    ]
    adv = torch.zeros(len(groups), 1, dtype=torch.float64)
    batch = RLBatch.build([list(p) for p in prompts], groups, adv, False, pad_id)
    rows = batch.rows(list(range(len(batch))))
    logp, ent = _logprobs_of(model, rows, temperature, precision, entropy)
    return logp, rows.response_mask.to(logp.device), ent


def _logprobs_of(
    model: nn.Module, rows: Rows, temperature: float, precision: str, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r = rows.response_mask.shape[1]
    return _response_logprobs(model, rows.ids, rows.attention_mask, r, temperature, precision, entropy)


# --------------------------------------------------------------------------------------------
# Collect: rollouts, rewards, dynamic sampling


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
    texts = [_completion_text(run, g.response_ids) for g in rollouts]
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
    return group


def _completion_text(run: Run, response_ids: list[int]) -> str:
    ids = response_ids[:-1] if response_ids and response_ids[-1] in run.stop_ids else response_ids
    return run.tokenizer.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------------------------
# Score and update


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
def _score(run: Run, batch: RLBatch, plan: Plan) -> dict[str, float]:
    """The trainer's ``old`` logprobs (and the reference's) of this rank's rows, their TIS weights, and
    the mismatch metrics and entropy over all ranks' rows."""
    cfg, env = run.cfg, run.env
    temperature, precision = cfg.rollout.temperature, cfg.model.precision
    old_all, roll_all, ent_sum = [], [], 0.0
    for mini in plan:
        for micro in my_micro_batches(mini, env.rank, env.world_size):
            rows = batch.rows(micro or mini[0])
            logp, ent = _logprobs_of(run.model, rows, temperature, precision, entropy=True)
            if micro is None:  # the padding forward: same collectives, nothing kept
                continue
            mask = rows.response_mask.to(logp.device)
            assert ent is not None
            ent_sum += float((ent * mask).sum())
            real = mask.bool()
            old = logp.masked_fill(~real, 0).cpu()
            batch.old_logp[rows.index, : old.shape[1]] = old
            if run.ref is not None:
                ref = _logprobs_of(run.ref, rows, temperature, precision)[0]
                batch.ref_logp[rows.index, : old.shape[1]] = ref.masked_fill(~real, 0).cpu()
            tis = tis_weights(old, rows.rollout_logp, tis_mode(cfg), cfg.algo.tis_cap)
            batch.tis[rows.index, : old.shape[1]] = tis.masked_fill(~real.cpu(), 0)
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
    return out


def _micro_loss(run: Run, batch: RLBatch, mini: list[list[int]], micro: list[int] | None) -> tuple[Any, Any]:
    """The summed token loss and statistics of ``micro`` (None: a forward of zero weight on ``mini[0]``)."""
    a = run.cfg.algo
    rows = batch.rows(micro or mini[0])
    logp, _ = _logprobs_of(run.model, rows, run.cfg.rollout.temperature, run.cfg.model.precision)
    dev = logp.device
    mask = rows.response_mask.to(dev) * (rows.keep.float() * float(micro is not None)).to(dev)[:, None]
    old = rows.old_logp.to(dev) if micro else logp.detach()
    tis = rows.tis.to(dev) if micro else None
    ref = rows.ref_logp.to(dev) if run.ref is not None and micro is not None else None
    adv = rows.adv.to(device=dev, dtype=logp.dtype)
    return policy_loss(logp, old, adv, mask, a.clip_low, a.clip_high, tis, a.kl_coef, ref)


def _update(run: Run, batch: RLBatch, plan: Plan) -> dict[str, float]:
    """One AdamW step per mini-batch of ``plan``; each rank backpropagates its micro-batches of it.

    The token-level loss is normalised by the token count of the whole mini-batch (all ranks), and
    scaled by the world size because FSDP2 averages the gradients over ranks: the gradient is the one
    process's. Loss and statistics are summed over ranks.
    """
    cfg, env = run.cfg, run.env
    sums = torch.zeros(4, dtype=torch.float64)  # clip_low, clip_high, kl, tokens
    losses, norms, skipped = [], [], 0
    for mini in plan:
        flat = torch.tensor([i for micro in mini for i in micro])
        n_tokens = int(batch.response_len[flat][batch.keep[flat]].sum())
        scale = env.world_size / max(n_tokens, 1)
        local = torch.zeros(5, dtype=torch.float64)  # the summed token loss, then the four sums above
        for micro in my_micro_batches(mini, env.rank, env.world_size):
            total, st = _micro_loss(run, batch, mini, micro)
            (total * scale).backward()
            stats = [float(total.detach())] + [
                float(st[k]) for k in ("clip_low", "clip_high", "kl", "tokens")
            ]
            local += torch.tensor(stats, dtype=torch.float64)
        local = all_reduce_sum(local.to(env.device), env).cpu()
        sums += local[1:]
        norm = clip_grad_norm(run.model, cfg.optim.grad_clip)
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
    lo, hi = share(len(run.val), run.env.rank, run.env.world_size)
    groups = run.engine.generate(run.val_ids[lo:hi], 1, seed=0, greedy=True)
    scores = [
        reward(run.cfg.algo.reward, p, _completion_text(run, g[0].response_ids))
        for g, p in zip(groups, run.val[lo:hi], strict=True)
    ]
    correct = torch.tensor([sum(scores)], dtype=torch.float64, device=run.env.device)
    return float(all_reduce_sum(correct, run.env)[0]) / len(run.val)


# --------------------------------------------------------------------------------------------
# The run


def _encode(tokenizer: Any, problems: list[Problem]) -> list[list[int]]:
    return [
        tokenizer(render_prompt(tokenizer, p.user_message), add_special_tokens=False)["input_ids"]
        for p in problems
    ]


def _load_inputs(cfg: RLConfig, model_given: bool) -> tuple[list[Problem], list[Problem]]:
    """What the config names, before any folder or model: the model folders (unless a model is given),
    the prompts and held-out problems (read here, once)."""
    if not cfg.data.prompts_path:
        raise ValueError('data.prompts_path: is required (a JSONL file of {"problem", "answer"} lines)')
    task = cfg.data.task
    problems = load_problems(cfg.data.prompts_path, task)
    val = load_problems(cfg.data.val_path, task)[: cfg.train.eval_problems] if cfg.data.val_path else []
    if not (model_given or cfg.model.path or cfg.model.from_config):
        raise ValueError(
            "model: give model.path (a local HF folder, e.g. the SFT run's <run>/hf) or model.from_config"
        )
    if not model_given:
        check_model_inputs(cfg)
    return problems, val


def _build_engine(cfg: RLConfig, model: nn.Module, tokenizer: Any) -> RolloutEngine:
    """``rollout.engine`` from the registry (``generation.ENGINES``), generating from a copy of the policy."""
    r = cfg.rollout
    options = EngineOptions(
        tokenizer,
        model=lambda: model,
        precision="served" if r.precision == "fp8" else "high",
        scale_encoding=r.scale_encoding,
        model_precision=cfg.model.precision,
        copy_model=True,
    )
    sampling = SamplingConfig(False, r.temperature, 1.0, r.max_new_tokens, r.batch_size)  # the policy itself
    return RolloutEngine(build_engine(r.engine, options), sampling)


def _setup(
    cfg: RLConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any, inputs: tuple[list[Problem], ...]
) -> Run:
    problems, val = inputs
    if tokenizer is None:
        tokenizer = load_run_tokenizer(cfg)  # read as `infir2 train` reads it (the model's type)
    if tokenizer is None:
        raise ValueError("model.tokenizer: a model built from_config needs a tokenizer folder")
    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    built: dict[str, Any] = {}

    def before_shard(whole: nn.Module) -> None:  # the engine and the reference copy the whole model
        built["engine"] = _build_engine(cfg, whole, tokenizer)
        if cfg.algo.kl_coef > 0:  # a whole copy on every rank (no collectives in its forwards)
            built["ref"] = copy.deepcopy(whole).eval().requires_grad_(False)

    model = setup_model(cfg, env, model, tokenizer, before_shard)
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.run.seed
    data = RolloutData(
        PromptStream(len(problems), cfg.data.shuffle, seed), torch.Generator().manual_seed(cfg.run.seed)
    )
    return Run(
        cfg,
        env,
        model,
        build_optimizer(model, cfg.optim),
        tokenizer,
        built["engine"],
        built.get("ref"),
        problems,
        _encode(tokenizer, problems),
        data,
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

    inputs: list[tuple[list[Problem], list[Problem]]] = []

    def check(env: DistEnv) -> None:  # before any folder or model
        inputs.append(_load_inputs(cfg, model is not None))

    with open_run(cfg.run_dir, cfg.run.device, check) as env:  # a run that fails to start leaves no folder
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        reconcile_saved_config(cfg, MEANINGFUL, write=env.is_main)  # refuses meaningful changes on resume
        return _run(_setup(cfg, env, model, tokenizer, inputs[0]), progress)


def _run(run: Run, progress: bool) -> RLResult:
    cfg, env = run.cfg, run.env
    state, resumed_from = restore(run.policy, env, run.model, run.optimizer, run.data, RLState, cfg.optim)
    run.engine.load_weights(run.model)
    result = RLResult(cfg.run_dir, state.step, resumed_from=resumed_from)
    t = cfg.train
    causes = "a non-finite loss or gradient norm or a rollout mismatch above train.max_prob_error"
    guard = StepGuard(t.max_nonfinite_in_row, "train.max_nonfinite_in_row", causes, ADVICE)
    with MetricsLogger(
        cfg.run_dir, env.is_main, state.step, t.max_steps, t.log_every, progress, "rl"
    ) as logger:
        while state.step < t.max_steps:
            metrics = _step(run, state)
            last = state.step == t.max_steps
            if run.val and (last or (t.eval_every and state.step % t.eval_every == 0)):
                metrics["val_accuracy"] = _evaluate(run)
            logger.log(metrics)
            result.history.append(metrics)
            guard.record(state, metrics.get("skipped"), logger.message, result.checkpoint or resumed_from)
            if t.save_every and state.step % t.save_every == 0 and not last and not state.nonfinite_in_row:
                result.checkpoint = _save(run, state).wait()
        result.step = state.step
        if state.step and not state.nonfinite_in_row:
            result.checkpoint = _save(run, state).wait()
        result.hf_dir = export_final(cfg.run_dir, env, run.model, run.tokenizer, cfg.model)
    return result


def _save(run: Run, state: RLState) -> PendingSave:
    return save(run.policy, run.env, run.model, run.optimizer, run.data, state, config_to_dict(run.cfg))


def _why_skipped(run: Run, metrics: dict[str, Any]) -> str | None:
    gate = run.cfg.train.max_prob_error
    if gate is not None and metrics.get("mismatch/prob_error", 1.0) > gate:
        return f"rollout mismatch: token probability error {metrics['mismatch/prob_error']:.4g} > {gate}"
    return None


def _step(run: Run, state: RLState) -> dict[str, Any]:
    t0 = time.perf_counter()
    groups, stats = collect_groups(run)
    t1 = time.perf_counter()
    metrics: dict[str, Any] = {"step": state.step + 1, **stats}
    idle = {"loss": 0.0, "grad_norm": 0.0, "lr": run.cfg.optim.lr, "updates": 0, "skipped_updates": 0}
    if groups:  # the same batch on every rank: all take this branch
        a = run.cfg.algo
        adv = group_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float64), a.adv_eps)
        batch = RLBatch.build(run.prompt_ids, groups, adv, a.overlong == "mask", run.pad_id)
        plan = plan_batches(list(range(len(batch))), a.updates_per_batch, a.micro_batch_size)
        metrics |= _score(run, batch, plan)
        why = _why_skipped(run, metrics)
        metrics |= _update(run, batch, plan) if why is None else idle | {"skipped_updates": len(plan)}
        if metrics["skipped_updates"] and why is None:
            why = f"non-finite loss or gradient norm, {metrics['skipped_updates']} update(s) skipped"
        if why is not None:
            metrics["skipped"] = why
        run.engine.load_weights(run.model)
    else:
        metrics |= idle
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
