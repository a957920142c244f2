"""The training loop: ``train(config) -> TrainResult``, for CPT and SFT, FP8 or BF16, 1 to N processes.

One optimizer step, top to bottom (``train_step``):

1. count the loss tokens of the whole global batch (this rank's micro-batches, summed over ranks);
2. for each micro-batch: forward (bf16 autocast or fp32 for the high-precision parts, FP8 GEMMs in
   the projections; ``cache_fp8_weights`` with ``fp8.weight_cache``: each layer's FP8 weight quantized
   in its forward and freed after its backward, or once per step and kept for it), summed token
   cross-entropy, backward of ``sum_ce * world_size / n_loss_tokens`` -- so that after FSDP averages
   gradients over ranks the step's gradient is that of the per-token mean over the global batch;
3. clip the global gradient norm; if the loss or the norm is not finite, or the loss spikes (more than
   ``train.loss_spike_nats`` above the median loss of the last ``train.loss_spike_window`` updated
   steps, the guard against a diverging run whose loss stays finite), skip the update (counted,
   logged; ``train.max_skipped_in_row`` such steps in a row stop the run, and no checkpoint is
   written during a streak);
4. AdamW at the schedule's learning rate for this step.

Around it: evaluation every ``train.eval_every`` steps from ``train.eval_from`` on (``evaluate``: the held-out loss of
``infir2.loss``, the definition ``infir2 eval --perplexity`` uses), a checkpoint every
``train.save_every`` steps and at the end (``train.checkpoint_format``: full state on rank 0 or DCP
shards per rank; ``train.async_save`` lets the loop go on while a DCP save writes -- it is waited on
before the next save and at the end), auto-resume from the run folder's latest checkpoint, FP8
numerics telemetry every ``fp8.stats_every`` steps (``infir2.nn.telemetry``: per-layer keys ``fp8/...``
in the metrics), and the final export as a Hugging Face folder ``<run>/hf``. The run folder, the model,
checkpoints, resume, metrics and the step guards are the run harness's (``infir2.harness``, shared with
``infir2 rl``); the data comes from ``setup.py``. The run folder also holds ``config.yaml`` (resolved),
``metrics.jsonl`` and ``tensorboard/``.

With ``parallel.context: C`` (context parallelism, docs/DISTRIBUTED.md) the world is data x context: the
sources split over the data ranks, every micro-batch is this rank's shard of the sequence
(``data.context``), attention runs over the context group (``nn.context_parallel``), and the loss scale
above is unchanged -- the shards' loss tokens add up to the sequences', and FSDP2 averages over the
whole world.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import first_difference, load_tokenizer
from ..data.base import MicroBatch, StepSource, count_loss_tokens
from ..data.context import ContextShards, shard_steps
from ..harness.config import config_to_dict
from ..harness.config_changes import reconcile_saved_config
from ..harness.distributed import ContextLayout, DistEnv, all_reduce_sum, context_layout
from ..harness.guards import NonFiniteError, SpikeRule, StepGuard
from ..harness.metrics import MetricsLogger, peak_memory_gib
from ..harness.optim import Schedule, build_optimizer, make_schedule
from ..harness.resume import LoadRequest, PendingSave, SavePolicy, export_final, restore, save
from ..harness.run import open_run
from ..harness.setup import load_run_tokenizer, setup_model
from ..harness.step import apply_update, loss_scale, rounding_noise, step_seed
from ..loss import heldout_loss, shard_context, token_ce_sum
from ..model import check_context
from ..nn import cache_fp8_weights, fp8_modules
from ..nn.context_parallel import enable_context_parallel
from ..nn.telemetry import Fp8Telemetry
from .config import MEANINGFUL, RunConfig, resolve_checkpoint_format
from .setup import ValSteps, build_sources, check_inputs, rewinding, total_steps

__all__ = [
    "NonFiniteError",
    "TrainResult",
    "TrainState",
    "ValSteps",
    "build_sources",
    "evaluate",
    "train",
    "train_step",
]

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The loop's own counters; saved under ``train_state`` in every checkpoint."""

    step: int = 0  # optimizer steps done (skipped ones included)
    tokens_seen: int = 0
    skipped_total: int = 0
    skipped_in_row: int = 0


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # steps done when the run ended
    history: list[dict[str, Any]] = field(default_factory=list)  # per-step metrics of this invocation
    checkpoint: Path | None = None  # the last checkpoint written
    hf_dir: Path | None = None  # the exported Hugging Face folder
    resumed_from: Path | None = None

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def final_loss(self) -> float | None:
        losses = [m["loss"] for m in self.history if not m.get("skipped")]
        return losses[-1] if losses else None

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of this invocation: all tokens / all step time, the first step (warm-up) left out."""
        timed = self.history[1:] or self.history
        seconds = sum(m["step_time_s"] for m in timed)
        return sum(m["tokens"] for m in timed) / seconds if seconds > 0 else None

    @property
    def final_val_loss(self) -> float | None:
        losses = [m["val_loss"] for m in self.history if "val_loss" in m]
        return losses[-1] if losses else None


# --------------------------------------------------------------------------------------------
# One step


def _num_tokens(mb: MicroBatch) -> int:
    mask = mb.get("attention_mask")
    return int(mask.sum()) if mask is not None else mb["input_ids"].numel()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    lr: float,
    grad_clip: float,
    precision: str,
    env: DistEnv,
    loss_chunk_tokens: int | str = "auto",
    max_loss: float = math.inf,
    noise_seed: int | None = None,
    weight_cache: str = "layer",
) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches, clip, and one AdamW step -- skipped when the loss
    or the gradient norm is not finite, or the loss is above ``max_loss`` (a spike, ``out["spike"]``).

    ``noise_seed`` (the step's, ``harness.step.step_seed``): each micro-batch's stochastic rounding
    (``nvfp4``) draws from a generator seeded by it and the micro-batch's index in the global batch
    (``harness.step.rounding_noise``), so the draws do not depend on how the micro-batches are spread
    over processes; None: torch's generator. The loss scale and the tail (clip, the AdamW step when
    finite and no spike, gradients freed) are the harness's (``harness.step``).
    ``weight_cache``: how long the FP8 weight copies live (``fp8.weight_cache``, ``cache_fp8_weights``)."""
    counts = torch.tensor(
        [count_loss_tokens(micro_batches), sum(map(_num_tokens, micro_batches))], dtype=torch.float64
    )
    n_loss_tokens, n_tokens = all_reduce_sum(counts.to(env.device), env).tolist()
    scale = loss_scale(env.world_size, n_loss_tokens)
    ce_total = torch.zeros((), dtype=torch.float64, device=env.device)
    with cache_fp8_weights(model, weight_cache):
        for i, mb in enumerate(micro_batches):
            index = env.rank * len(micro_batches) + i  # the micro-batch's place in the global batch
            with shard_context(mb), rounding_noise(noise_seed, index, device=env.device):
                # shard_context: a context shard's backward gathers keys and values too
                ce_sum = token_ce_sum(model, mb, precision, env.device, loss_chunk_tokens)
                (ce_sum * scale).backward()
            ce_total += ce_sum.detach().double()
    loss = float(all_reduce_sum(ce_total, env)) / max(n_loss_tokens, 1.0)
    done = apply_update(model, optimizer, loss, lr, grad_clip, hold=loss > max_loss)
    grad_norm, spike = done.grad_norm, done.finite and loss > max_loss
    return {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "loss_tokens": int(n_loss_tokens),
        "tokens": int(n_tokens),
        "skipped": not done.stepped,
        "spike": spike,
    }


def evaluate(
    model: nn.Module,
    steps: Iterable[list[MicroBatch]],
    batches: int,
    precision: str,
    env: DistEnv,
    fp8: bool = False,
    loss_chunk_tokens: int | str = "auto",
) -> float:
    """Per-token loss over the first ``batches`` steps of ``steps``, all ranks (``infir2.loss.heldout_loss``)."""
    loss, _ = heldout_loss(
        model,
        steps,
        precision,
        env.device,
        fp8,
        max_steps=batches,
        reduce=lambda totals: all_reduce_sum(totals, env),
        loss_chunk_tokens=loss_chunk_tokens,
    )
    return loss


# --------------------------------------------------------------------------------------------
# The run


def _step_metrics(
    step: int, out: dict[str, Any], seconds: float, state: TrainState, env: DistEnv
) -> dict[str, Any]:
    return {
        "step": step,
        **out,
        "tokens_per_s": out["tokens"] / seconds if seconds > 0 else math.nan,
        "step_time_s": seconds,
        "tokens_seen": state.tokens_seen,
        "skipped_total": state.skipped_total,
        "peak_mem_gib": peak_memory_gib(env.device),
    }


#: what to try when skipped steps stop a training run
ADVICE = "Lower optim.lr, check the data, or try another fp8.recipe, then resume with --load that checkpoint"


def _why_skipped(out: dict[str, Any], cfg: RunConfig) -> str | None:
    """Why this step's update was skipped, in words (None: it was not)."""
    if not out["skipped"]:
        return None
    if out.get("spike"):
        return (
            f"loss spike {out['loss']:.4g}, more than train.loss_spike_nats={cfg.train.loss_spike_nats} above "
            f"the median {out['spike_reference']:.4g} of the last steps"
        )
    return f"non-finite loss {out['loss']} or grad norm {out['grad_norm']}"


def _due(step: int, every: int, last: bool, start: int = 0) -> bool:
    return last or (every > 0 and step % every == 0 and step >= start)


@dataclass
class _Run:
    """What the loop works with (built once by ``_setup``)."""

    cfg: RunConfig
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    source: StepSource
    val_steps: ValSteps | None
    n_steps: int
    schedule: Schedule
    telemetry: Fp8Telemetry  # fp8.stats_every: 0 = off, no layer touched

    @property
    def policy(self) -> SavePolicy:
        t = self.cfg.train
        return SavePolicy(self.cfg.run_dir / "checkpoints", t.checkpoint_format, t.keep_last, t.async_save)


def train(
    cfg: RunConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    train_source: StepSource | None = None,
    val_source: StepSource | ValSteps | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run (or resume) the training that ``cfg`` describes; returns metrics and output paths.

    ``model`` (an unconverted HF causal LM), ``tokenizer`` and the sources may be passed in (the demo
    and tests do); otherwise they are built from ``cfg``. ``val_source`` is a ``StepSource`` (rewound
    to its current position before every evaluation) or a function returning fresh validation steps.
    Under ``torchrun`` every rank calls this.
    """

    def check(env: DistEnv) -> None:  # before any folder, model or data
        check_inputs(cfg, env.world_size, data=train_source is None)

    with open_run(cfg.run_dir, cfg.run.device, check) as env:  # a run that fails to start leaves no folder
        cfg = resolve_checkpoint_format(cfg, env.world_size)  # auto: dcp on several processes
        run = _setup(cfg, env, model, tokenizer, train_source, val_source)
        return _run(run, progress)


def _setup(
    cfg: RunConfig,
    env: DistEnv,
    model: nn.Module | None,
    tokenizer: Any,
    train_source: StepSource | None,
    val_source: StepSource | ValSteps | None,
) -> _Run:
    forced = cfg.load.force and cfg.load.path is not None  # --load: the run starts elsewhere
    reconcile_saved_config(cfg, MEANINGFUL, write=env.is_main, resumes_own=not forced)
    if tokenizer is None:
        tokenizer = load_run_tokenizer(cfg)
    layout = context_layout(env, cfg.parallel.context)  # every rank: it makes the context groups
    model = setup_model(cfg, env, model, tokenizer)
    if train_source is None and cfg.data.kind == "cpt":
        check_context(model, cfg.data.seq_len, "data.seq_len", cfg.model.beyond_context)
    optimizer = build_optimizer(model, cfg.optim)
    if train_source is None:
        train_source, val_steps = build_sources(cfg, tokenizer, layout.data_env)
        longest = max(getattr(train_source, "lengths", None) or [0])  # SFT: samples cut at data.max_length
        key = f"data.train_path: its longest sample ({longest} tokens after data.max_length)"
        check_context(model, longest, key, cfg.model.beyond_context)
    else:
        val_steps = rewinding(val_source) if isinstance(val_source, StepSource) else val_source
    if cfg.train.eval_fp8 and val_steps is not None and next(fp8_modules(model), None) is None:
        raise ValueError(
            f"train.eval_fp8: the model has no FP8 layers (fp8.recipe={cfg.fp8.recipe}); "
            "evaluate in FP8 only with an FP8 recipe"
        )
    if layout.context > 1:
        train_source, val_steps = _shard_context(model, layout, train_source, val_steps)
    n_steps = total_steps(cfg, train_source)
    schedule = make_schedule(cfg.schedule, cfg.optim.lr, n_steps)
    telemetry = Fp8Telemetry(model, cfg.fp8.stats_every)
    return _Run(cfg, env, model, optimizer, tokenizer, train_source, val_steps, n_steps, schedule, telemetry)


def _shard_context(
    model: nn.Module, layout: ContextLayout, source: StepSource, val_steps: ValSteps | None
) -> tuple[StepSource, ValSteps | None]:
    """Context parallelism: attention over the context group, every micro-batch this rank's shard."""
    enable_context_parallel(model, layout.group)
    rank, degree = layout.context_rank, layout.context
    sharded = ContextShards(source, rank, degree)
    if val_steps is None:
        return sharded, None
    val = val_steps
    return sharded, lambda: shard_steps(val(), rank, degree)


def _run(run: _Run, progress: bool) -> TrainResult:
    cfg, env = run.cfg, run.env
    torch.manual_seed(cfg.run.seed + env.rank)
    random.seed(cfg.run.seed + env.rank)
    load = LoadRequest(cfg.load.path, cfg.load.mode, cfg.load.reset_step, cfg.load.reset_data, cfg.load.force)
    state, resumed_from = restore(
        run.policy,
        env,
        run.model,
        run.optimizer,
        run.source,
        TrainState,
        cfg.optim,
        load,
        cfg.load.start_fresh,
    )
    result = TrainResult(cfg.run_dir, state.step, resumed_from=resumed_from)
    t = cfg.train
    with MetricsLogger(cfg.run_dir, env.is_main, state.step, run.n_steps, t.log_every, progress) as logger:
        pending = _loop(run, state, result, logger)
        _finish(run, state, result, logger, pending)
    return result


def _step(run: _Run, state: TrainState, micro_batches: list[MicroBatch], spikes: SpikeRule) -> dict[str, Any]:
    """One optimizer step (``train_step``) with the spike rule's limit, and its metrics."""
    cfg, t0 = run.cfg, time.perf_counter()
    limit = spikes.limit()
    with run.telemetry.record(state.step + 1) as fp8_stats:
        out = train_step(
            run.model,
            run.optimizer,
            micro_batches,
            run.schedule(state.step),
            cfg.optim.grad_clip,
            cfg.model.precision,
            run.env,
            cfg.train.loss_chunk_tokens,
            limit,
            step_seed(cfg.run.seed, state.step),
            cfg.fp8.weight_cache,
        )
    if out["spike"]:
        out["spike_reference"] = spikes.reference()
    elif not out["skipped"]:
        spikes.observe(out["loss"])
    state.step += 1
    state.tokens_seen += out["tokens"]
    return _step_metrics(state.step, out, time.perf_counter() - t0, state, run.env) | fp8_stats


def _loop(run: _Run, state: TrainState, result: TrainResult, logger: MetricsLogger) -> PendingSave | None:
    """Steps until ``n_steps`` (or the data ends): evaluate, log, guard, save. Returns the last periodic
    save (an async one may still be writing)."""
    cfg, t = run.cfg, run.cfg.train
    steps = iter(run.source)
    pending: PendingSave | None = None
    spikes = SpikeRule(t.loss_spike_nats, t.loss_spike_window)  # over the losses of updated steps
    causes = "a non-finite loss or gradient norm or a loss spike"
    guard = StepGuard(t.max_skipped_in_row, "train.max_skipped_in_row", causes, ADVICE)
    while state.step < run.n_steps:
        micro_batches = next(steps, None)
        if micro_batches is None:
            logger.message(f"data exhausted after {state.step} steps (of {run.n_steps})")
            break
        metrics = _step(run, state, micro_batches, spikes)
        last = state.step == run.n_steps
        if run.val_steps is not None and _due(state.step, t.eval_every, last, t.eval_from):
            metrics["val_loss"] = evaluate(
                run.model,
                run.val_steps(),
                t.eval_batches,
                cfg.model.precision,
                run.env,
                t.eval_fp8,
                t.loss_chunk_tokens,
            )
        logger.log(metrics)
        result.history.append(metrics)
        guard.record(
            state, _why_skipped(metrics, cfg), logger.message, result.checkpoint or result.resumed_from
        )
        if pending is not None and pending.ready(run.env):  # an async save is written: make it a checkpoint
            result.checkpoint, pending = pending.wait(), None
        if state.skipped_in_row:  # never during a streak: keep_last would delete the healthy one
            continue
        if t.save_every and state.step % t.save_every == 0 and not last:
            if pending is not None:  # an async save still writing: finish it first
                result.checkpoint = pending.wait()
            pending = _save(run, state)
    return pending


def _save(run: _Run, state: TrainState) -> PendingSave:
    return save(run.policy, run.env, run.model, run.optimizer, run.source, state, config_to_dict(run.cfg))


def _finish(
    run: _Run, state: TrainState, result: TrainResult, logger: MetricsLogger, pending: PendingSave | None
) -> None:
    """The last checkpoint (unless in a streak) and the export ``<run>/hf``."""
    result.step = state.step
    if pending is not None:
        result.checkpoint = pending.wait()
    if state.skipped_in_row:
        logger.message(
            f"ending in a streak of skipped steps: no checkpoint for step {state.step}; the last one is "
            f"{result.checkpoint or result.resumed_from}"
        )
    else:
        result.checkpoint = _save(run, state).wait()
    result.hf_dir = export_final(
        run.cfg.run_dir, run.env, run.model, run.tokenizer, run.cfg.model, result.checkpoint
    )
    if run.env.is_main and result.hf_dir is not None and run.tokenizer is not None:
        _check_export_tokenizer(run.tokenizer, result.hf_dir, logger)


def _check_export_tokenizer(tokenizer: Any, hf_dir: Path, logger: MetricsLogger) -> None:
    """Warn if ``AutoTokenizer`` on the export splits text otherwise than the run did (a passed-in tokenizer)."""
    difference = first_difference(tokenizer, load_tokenizer(hf_dir))
    if difference is not None:
        logger.message(
            f"warning: AutoTokenizer on {hf_dir} tokenizes {difference[0]!r} into {len(difference[2])} "
            f"tokens, the run's tokenizer into {len(difference[1])}: load the export's tokenizer "
            "with infir2.data.load_tokenizer(<tokenizer folder>, model_type=...) before training"
        )
