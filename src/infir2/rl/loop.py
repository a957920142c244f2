"""The RL loop: ``rl(config) -> RLResult``. One step, top to bottom (``_step``):

1. **collect** (``collect_groups``): draw ``rollout.oversample_prompts`` prompts, generate
   ``rollout.group_size`` responses each with the rollout engine (seeded from the run's sampler), grade
   them (``algo.reward``), shape the reward (``algo.overlong: penalty``), and keep the groups whose
   rewards do not all agree (dynamic sampling); repeat until ``rollout.prompts_per_step`` groups are
   kept or ``rollout.max_rounds`` rounds are done. Kept groups beyond the step's need are dropped, or
   with ``rollout.carry_over`` buffered for the next step (the buffer is part of every checkpoint);
2. **score** (``_score``): the step's ``RLBatch`` (``rl/batch.py``: padded tensors, built once), the
   trainer's log-probabilities of every response token before any update (``old``), the mismatch
   metrics against the engine's (``algorithm.mismatch_sums``, ``correction.correction_sums``), the TIS
   weights (``correction.correction_weights``: mode ``tis_mode(cfg)`` at ``algo.tis_level``, the rows
   ``algo.geo_mask`` drops at 0) and group advantages; with ``rollout.rescore`` the engine's
   log-probabilities are first replaced by the trainer's scorer run on its weights (``rl/rescore.py``);
   a mismatch above ``train.max_prob_error`` skips the step's updates (the engine no longer matches the
   policy: not a step to learn from);
3. **update**: ``algo.updates_per_batch`` mini-batches, each one AdamW step at the constant
   ``optim.lr`` on the token-level clipped objective (``algorithm.policy_loss``), gradients clipped;
   a non-finite loss or norm skips the update (``train.max_skipped_in_row`` skipped steps in a row
   stop the run with ``NonFiniteError``);
4. **sync**: the engine takes the new weights (``RolloutEngine.load_weights``: for FP8 rollouts, the
   128x128 quantization of the export, the other tensors in ``rollout.base_dtype``);
5. **guard** (``rl/guard.py``): the held-out accuracy (before step 1 and at every evaluation; greedy, or
   avg@k at the rollout temperature with ``train.eval_samples``) and the
   KL to the start model against ``guard.*``; a trip warns, or with ``guard.stop`` ends the run with
   ``hf/`` exported from the best held-out weights.

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
  mini-batch's tokens and multiplied by N (FSDP2 averages gradients); statistics are all-reduced.
  With ``parallel.context: C`` micro-batch k runs on data replica ``k % (N / C)``, each of its rows split
  along the sequence over the replica's C ranks (``rl/context.py``); the rollouts are not split;
* **sync**: every rank's engine all-gathers the whole weights (``generation.BuiltinEngine.load_weights``);
* **validation**: each rank scores its share of the held-out problems; the counts are all-reduced;
* **checkpoint / export**: full state dicts gathered to rank 0, which writes them. Prompt position,
  sampler, buffer and RNG are the same on every rank, so a checkpoint resumes on any number of processes.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.chat import render_prompt, stop_token_ids
from ..generation import (
    EngineOptions,
    RolloutEngine,
    SamplingConfig,
    build_engine,
    derive_seeds,
    stops_and_pad,
    use_exact_numerics,
)
from ..harness.config import config_to_dict
from ..harness.config_changes import reconcile_saved_config
from ..harness.distributed import DistEnv, all_reduce_sum, context_layout, context_parallel, data_ranks
from ..harness.grads import check_grad_dtype
from ..harness.guards import StepGuard
from ..harness.metrics import MetricsLogger, peak_memory_gib
from ..harness.optim import build_optimizer
from ..harness.resume import PendingSave, export_final, restore, save
from ..harness.run import open_run
from ..harness.setup import check_model_inputs, load_run_tokenizer, setup_model
from ..harness.step import step_seed
from ..model import check_context, check_positions, config_limits
from ..planning.check import warn_if_unfit
from ..tasks import Problem, load_problems, reward
from .algorithm import group_advantages
from .batch import RLBatch
from .collect import collect_groups, completion_text, share
from .config import MEANINGFUL, RLConfig, keeps_reference, tis_mode
from .guard import CollapseGuard
from .plan_inputs import plan_inputs
from .prompts import PromptStream
from .rescore import rescore
from .state import RLState, RolloutData, Run
from .update import my_micro_batches, plan_batches, score, update

__all__ = [
    "RLResult",
    "RLState",
    "RolloutData",
    "collect_groups",
    "my_micro_batches",
    "plan_batches",
    "rl",
    "share",
]

#: what to try when skipped steps stop an RL run
ADVICE = "Lower optim.lr or try another fp8.recipe, then rerun (it resumes from the last checkpoint)"


@dataclass
class RLResult:
    run_dir: Path
    step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None
    hf_dir: Path | None = None
    resumed_from: Path | None = None


#: the seed of the held-out samples (``train.eval_samples``): the same draws at every evaluation and in
#: every run, so that two evaluations differ by the weights alone
EVAL_SEED = 0


def _evaluate(run: Run) -> float:
    """Held-out accuracy with the engine's current weights (each rank its share): greedy, or with
    ``train.eval_samples: k`` the mean reward of k samples per problem at the rollout temperature
    (avg@k), each problem's draws seeded by its index alone (``EVAL_SEED``), whatever the ranks."""
    k = run.cfg.train.eval_samples
    lo, hi = share(len(run.val), run.env.rank, run.env.world_size)
    seeds = derive_seeds(EVAL_SEED, len(run.val))[lo:hi]
    groups = run.engine.generate(run.val_ids[lo:hi], k or 1, seeds, greedy=k is None)
    scores = [
        reward(run.cfg.algo.reward, p, completion_text(run, s.response_ids))
        for g, p in zip(groups, run.val[lo:hi], strict=True)
        for s in g
    ]
    correct = torch.tensor([sum(scores)], dtype=torch.float64, device=run.env.device)
    return float(all_reduce_sum(correct, run.env)[0]) / (len(run.val) * (k or 1))


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
    """``rollout.engine`` from the registry (``generation.ENGINES``) with its own settings (the ``engine``
    section), generating from a copy of the policy that ``load_weights`` refreshes."""
    r = cfg.rollout
    options = EngineOptions(
        tokenizer=tokenizer,
        model=lambda: model,
        precision=r.precision,
        scale_encoding=r.scale_encoding,
        model_precision=cfg.model.precision,  # auto-dtypes and autocast: as the trainer computes
        copy_model=True,
        base_dtype={"bf16": torch.bfloat16, "fp32": None}[r.base_dtype],
        record_routes=cfg.algo.routing_replay == "rollout",  # the engine records each token's experts
        exact=r.exact,  # rollout.exact: the engine decodes with the trainer's numerics (nn.exact)
    )
    sampling = SamplingConfig(  # the policy itself: no top-p / top-k
        greedy=False,
        temperature=r.temperature,
        top_p=1.0,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        beyond_context=cfg.model.beyond_context,
    )
    return RolloutEngine(build_engine(r.engine, options, cfg.engine), sampling)


def _setup(
    cfg: RLConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any, inputs: tuple[list[Problem], ...]
) -> Run:
    problems, val = inputs
    if tokenizer is None:
        tokenizer = load_run_tokenizer(cfg)  # read as `infir2 train` reads it (the model's type)
    if tokenizer is None:
        raise ValueError("model.tokenizer: a model built from_config needs a tokenizer folder")
    stops = stop_token_ids(tokenizer)
    pad_id = stops_and_pad(tokenizer)[1]  # the engines' rule (a tokenizer with no stop token is refused)
    built: dict[str, Any] = {}

    def before_shard(whole: nn.Module) -> None:  # the engine and the reference copy the whole model
        if cfg.rollout.exact:  # the trainer's forward as the engine decodes (nn.exact)
            use_exact_numerics(whole)
        built["engine"] = _build_engine(cfg, whole, tokenizer)
        if keeps_reference(cfg):  # the loss's KL, or the guard's: a whole copy on every rank (no collectives)
            built["ref"] = copy.deepcopy(whole).eval().requires_grad_(False)

    prompt_ids, val_ids = _encode(tokenizer, problems), _encode(tokenizer, val)
    longest = max(map(len, prompt_ids + val_ids), default=0)
    key = f"the longest prompt ({longest} tokens) + rollout.max_new_tokens ({cfg.rollout.max_new_tokens})"
    if model is None and cfg.model.path:  # against config.json, before any weights are read
        positions = config_limits(cfg.model.path)[1]
        check_positions(positions, longest + cfg.rollout.max_new_tokens, key, cfg.model.beyond_context)
        # the planned step against this device: one warning if over
        warn_if_unfit(plan_inputs(cfg), env, longest, cfg.model.path, cfg.run.name)
    layout = context_layout(env, cfg.parallel.context)  # every rank: it makes the context groups
    model = context_parallel(setup_model(cfg, env, model, tokenizer, before_shard), layout)
    check_context(model, longest + cfg.rollout.max_new_tokens, key, cfg.model.beyond_context)
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.run.seed
    data = RolloutData(
        PromptStream(len(problems), cfg.data.shuffle, seed), torch.Generator().manual_seed(cfg.run.seed)
    )
    return Run(
        cfg=cfg,
        env=env,
        model=model,
        optimizer=build_optimizer(model, cfg.optim),
        tokenizer=tokenizer,
        engine=built["engine"],
        ref=context_parallel(built["ref"], layout) if "ref" in built else None,  # scored like the policy
        problems=problems,
        prompt_ids=prompt_ids,
        data=data,
        stop_ids=stops,
        pad_id=pad_id,
        val=val,
        val_ids=val_ids,
        context=layout,
    )


def rl(
    cfg: RLConfig, *, model: nn.Module | None = None, tokenizer: Any = None, progress: bool = True
) -> RLResult:
    """Run (or resume) the RL run ``cfg`` describes. ``model`` (an unconverted HF causal LM) and
    ``tokenizer`` may be passed in (tests do); otherwise they are loaded from ``cfg.model``. Under
    ``torchrun`` every rank calls this (the module doc says what each rank does)."""

    inputs: list[tuple[list[Problem], list[Problem]]] = []

    def check(env: DistEnv) -> None:  # before any folder or model
        data_ranks(env.world_size, cfg.parallel.context)  # the world is data x context
        check_grad_dtype(cfg.optim.grad_dtype, env.world_size)
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
    guard = StepGuard(t.max_skipped_in_row, "train.max_skipped_in_row", causes, ADVICE)
    collapse, stopped = _collapse_guard(run, state.step), False
    with MetricsLogger(
        cfg.run_dir, env.is_main, state.step, t.max_steps, t.log_every, progress, "rl"
    ) as logger:
        while state.step < t.max_steps and not stopped:
            metrics = _step(run, state)
            last = state.step == t.max_steps
            if run.val and (last or (t.eval_every and state.step % t.eval_every == 0)):
                metrics["val_accuracy"] = _evaluate(run)
            verdict = collapse.check(metrics, run.model)
            if verdict.why is not None:
                metrics["guard"] = verdict.why
                logger.message(verdict.why + (": stopping (guard.stop)" if cfg.guard.stop else ""))
                stopped = cfg.guard.stop
            logger.log(metrics)
            result.history.append(metrics)
            guard.record(state, metrics.get("skipped"), logger.message, result.checkpoint or resumed_from)
            if t.save_every and state.step % t.save_every == 0 and not last and not state.skipped_in_row:
                result.checkpoint = _save(run, state).wait()
            if env.is_main and (run.val or collapse.trips):
                collapse.write(cfg.run_dir / GUARD_FILE, stopped)
        result.step = state.step
        if state.step and not state.skipped_in_row:
            result.checkpoint = _save(run, state).wait()
        if stopped:  # the checkpoint keeps where the run stopped; hf/ the best held-out weights
            collapse.restore_best(run.model)
        result.hf_dir = export_final(cfg.run_dir, env, run.model, run.tokenizer, cfg.model)
    return result


#: the collapse guard's record in the run folder (start and best held-out accuracy, trips)
GUARD_FILE = "guard.json"


def _collapse_guard(run: Run, step: int) -> CollapseGuard:
    """The guard, with the held-out accuracy of the start: measured now (step 0), or on resume read back
    from ``guard.json``."""
    collapse = CollapseGuard(run.cfg.guard)
    if not run.val:
        return collapse
    path = run.cfg.run_dir / GUARD_FILE
    if step == 0:
        collapse.start(_evaluate(run), run.model)
    elif path.is_file():
        saved = json.loads(path.read_text())
        collapse.val_start, collapse.best = saved["val_start"], saved["best_val_accuracy"]
        collapse.best_step, collapse.trips = saved["best_step"], saved["trips"]
    return collapse


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
        if run.cfg.rollout.rescore:  # before the sync: the engine holds the weights it sampled with
            metrics["rescore_time_s"] = rescore(run, batch, plan)
        metrics |= score(run, batch, plan)
        why = _why_skipped(run, metrics)
        seed = step_seed(run.cfg.run.seed, state.step)  # the update's stochastic rounding (nvfp4)
        metrics |= update(run, batch, plan, seed) if why is None else idle | {"skipped_updates": len(plan)}
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
        "refit_time_s": run.engine.refit_s if groups else 0.0,  # the sync (step 4) into the engine
        "rollout_dtype": getattr(run.engine.engine, "served_dtype", None),  # what the engine computed in
        "samples_seen": state.samples_seen,
        "peak_mem_gib": peak_memory_gib(run.env.device),
    }
    return metrics
