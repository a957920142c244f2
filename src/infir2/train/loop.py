"""The training loop: ``train(config) -> TrainResult``, for CPT and SFT, FP8 or BF16, 1 to N processes.

One optimizer step, top to bottom (``train_step``):

1. count the loss tokens of the whole global batch (this rank's micro-batches, summed over ranks);
2. for each micro-batch: forward (bf16 autocast or fp32 for the high-precision parts, FP8 GEMMs in
   the projections, each weight quantized once per step by ``cache_fp8_weights``), summed token
   cross-entropy, backward of ``sum_ce * world_size / n_loss_tokens`` -- so that after FSDP averages
   gradients over ranks the step's gradient is that of the per-token mean over the global batch;
3. clip the global gradient norm; if the loss or the norm is not finite, or the loss spikes (more than
   ``train.loss_spike_nats`` above the median loss of the last ``train.loss_spike_window`` updated
   steps, the guard against a diverging run whose loss stays finite), skip the update (counted,
   logged; ``train.max_nonfinite_in_row`` such steps in a row stop the run, and no checkpoint is
   written during a streak);
4. AdamW at the schedule's learning rate for this step.

Around it: evaluation every ``train.eval_every`` steps (``evaluate``: the held-out loss of
``infir2.loss``, the definition ``infir2 eval --perplexity`` uses), a checkpoint every
``train.save_every`` steps and at the end (``train.checkpoint_format``: full state on rank 0 or DCP
shards per rank; ``train.async_save`` lets the loop go on while a DCP save writes -- it is waited on
before the next save and at the end), auto-resume from the run folder's latest checkpoint, FP8
numerics telemetry every ``fp8.stats_every`` steps (``infir2.nn.telemetry``: per-layer keys ``fp8/...``
in the metrics), and the final export as a Hugging Face folder ``<run>/hf`` (``checkpointing.py``).
The model and the data come from ``setup.py``. The run folder also holds ``config.yaml`` (resolved),
``metrics.jsonl`` and ``tensorboard/``.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import check_room_for_saves
from ..data import first_difference, load_tokenizer
from ..data.base import MicroBatch, StepSource, count_loss_tokens
from ..loss import heldout_loss, token_ce_sum
from ..nn import cache_fp8_weights, fp8_modules
from ..nn.telemetry import Fp8Telemetry
from .checkpointing import PendingSave, TrainState, export_final, restore, save
from .config import RunConfig, resolve_checkpoint_format
from .config_changes import reconcile_saved_config
from .distributed import DistEnv, all_reduce_sum, init_distributed
from .lock import run_lock
from .metrics import MetricsLogger, peak_memory_gib
from .optim import Schedule, build_optimizer, make_schedule
from .setup import (
    ValSteps,
    build_sources,
    check_inputs,
    load_run_tokenizer,
    rewinding,
    setup_model,
    total_steps,
)

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


class NonFiniteError(ValueError):
    """Too many consecutive steps with a non-finite loss or gradient norm.

    A ``ValueError``: the CLI prints it as one line (exit code 2). It names the last checkpoint written
    before the streak -- none is written during one, so ``train.keep_last`` never deletes it.
    """


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


def _grad_norm(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


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
) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches, clip, and one AdamW step -- skipped when the loss
    or the gradient norm is not finite, or the loss is above ``max_loss`` (a spike, ``out["spike"]``)."""
    counts = torch.tensor(
        [count_loss_tokens(micro_batches), sum(map(_num_tokens, micro_batches))], dtype=torch.float64
    )
    n_loss_tokens, n_tokens = all_reduce_sum(counts.to(env.device), env).tolist()
    scale = env.world_size / max(n_loss_tokens, 1.0)
    ce_total = torch.zeros((), dtype=torch.float64, device=env.device)
    with cache_fp8_weights(model):
        for mb in micro_batches:
            ce_sum = token_ce_sum(model, mb, precision, env.device, loss_chunk_tokens)
            (ce_sum * scale).backward()
            ce_total += ce_sum.detach().double()
    loss = float(all_reduce_sum(ce_total, env)) / max(n_loss_tokens, 1.0)
    grad_norm = _grad_norm(model, grad_clip)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    spike = finite and loss > max_loss
    if finite and not spike:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "loss_tokens": int(n_loss_tokens),
        "tokens": int(n_tokens),
        "skipped": not finite or spike,
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
        "nonfinite_total": state.nonfinite_total,
        "peak_mem_gib": peak_memory_gib(env.device),
    }


def _count_nonfinite(
    state: TrainState,
    out: dict[str, Any],
    cfg: RunConfig,
    logger: MetricsLogger,
    last_checkpoint: Path | None,
) -> None:
    if not out["skipped"]:
        state.nonfinite_in_row = 0
        return
    state.nonfinite_total += 1
    state.nonfinite_in_row += 1
    why = (
        f"loss spike {out['loss']:.4g}, more than train.loss_spike_nats={cfg.train.loss_spike_nats} above the "
        f"median {out['spike_reference']:.4g} of the last steps"
        if out.get("spike")
        else f"non-finite loss {out['loss']} or grad norm {out['grad_norm']}"
    )
    logger.message(
        f"step {state.step}: {why}: update skipped ({state.nonfinite_in_row} in a row, "
        f"{state.nonfinite_total} in total)"
    )
    if state.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
        where = (
            f"the last checkpoint written before the streak is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written before the streak"
        )
        raise NonFiniteError(
            f"stopping at step {state.step}: {state.nonfinite_in_row} steps in a row had a "
            f"non-finite loss or gradient norm or a loss spike (train.max_nonfinite_in_row="
            f"{cfg.train.max_nonfinite_in_row}; last: {why}); {where}. Lower optim.lr, check the "
            f"data, or try another fp8.recipe, then resume with --load that checkpoint"
        )


def _spike_limit(recent: deque[float], nats: float | None) -> float:
    """The loss above which a step is a spike: ``nats`` above the median of ``recent`` (inf without history)."""
    if nats is None or not recent:
        return math.inf
    return statistics.median(recent) + nats


def _due(step: int, every: int, last: bool) -> bool:
    return last or (every > 0 and step % every == 0)


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
    env = init_distributed(cfg.run.device)
    cfg = resolve_checkpoint_format(cfg, env.world_size)  # auto: dcp on several processes
    created = env.is_main and not cfg.run_dir.exists()
    try:
        check_inputs(cfg, env.world_size, data=train_source is None)  # before any folder, model or data
        with run_lock(cfg.run_dir, enabled=env.is_main):  # one process (group) per run folder
            return _run(cfg, env, model, tokenizer, train_source, val_source, progress)
    except Exception:
        if created:
            _remove_if_unstarted(cfg.run_dir)
        raise
    finally:
        env.close()


def _remove_if_unstarted(run_dir: Path) -> None:
    """A run folder this call created, whose start failed (no step logged, no checkpoint): remove it."""
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.exists():  # the inputs were refused before the folder was made
        return
    if any((run_dir / "checkpoints").glob("step_*")) or (metrics.exists() and metrics.stat().st_size):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    log.info("removed %s: the run did not start", run_dir)


def _run(
    cfg: RunConfig,
    env: DistEnv,
    model: nn.Module | None,
    tokenizer: Any,
    train_source: StepSource | None,
    val_source: StepSource | ValSteps | None,
    progress: bool,
) -> TrainResult:
    run_dir = cfg.run_dir
    reconcile_saved_config(cfg, write=env.is_main)  # refuses meaningful changes on resume; keeps the old one
    if tokenizer is None:
        tokenizer = load_run_tokenizer(cfg)
    model = setup_model(cfg, env, model, tokenizer)
    optimizer = build_optimizer(model, cfg.optim)
    if train_source is None:
        train_source, val_steps = build_sources(cfg, tokenizer, env)
    else:
        val_steps = rewinding(val_source) if isinstance(val_source, StepSource) else val_source
    if cfg.train.eval_fp8 and val_steps is not None and next(fp8_modules(model), None) is None:
        raise ValueError(
            f"train.eval_fp8: the model has no FP8 layers (fp8.recipe={cfg.fp8.recipe}); "
            "evaluate in FP8 only with an FP8 recipe"
        )
    n_steps = total_steps(cfg, train_source)
    schedule: Schedule = make_schedule(cfg.schedule, cfg.optim.lr, n_steps)
    torch.manual_seed(cfg.run.seed + env.rank)
    random.seed(cfg.run.seed + env.rank)
    state, resumed_from = restore(cfg, env, model, optimizer, train_source)
    check_room_for_saves(run_dir, model, optimizer, cfg.train.keep_last)  # a full disk: refused at the start
    result = TrainResult(run_dir, state.step, resumed_from=resumed_from)
    telemetry = Fp8Telemetry(model, cfg.fp8.stats_every)  # fp8.stats_every: 0 = off, no layer touched
    with MetricsLogger(run_dir, env.is_main, state.step, n_steps, cfg.train.log_every, progress) as logger:
        steps = iter(train_source)
        pending: PendingSave | None = None  # the last periodic save (async: maybe still writing)
        recent: deque[float] = deque(maxlen=cfg.train.loss_spike_window)  # losses of updated steps
        while state.step < n_steps:
            t0 = time.perf_counter()
            micro_batches = next(steps, None)
            if micro_batches is None:
                logger.message(f"data exhausted after {state.step} steps (of {n_steps})")
                break
            limit = _spike_limit(recent, cfg.train.loss_spike_nats)
            with telemetry.record(state.step + 1) as fp8_stats:
                out = train_step(
                    model,
                    optimizer,
                    micro_batches,
                    schedule(state.step),
                    cfg.optim.grad_clip,
                    cfg.model.precision,
                    env,
                    cfg.train.loss_chunk_tokens,
                    limit,
                )
            if out["spike"]:
                out["spike_reference"] = limit - (cfg.train.loss_spike_nats or 0.0)
            elif not out["skipped"]:
                recent.append(out["loss"])
            state.step += 1
            state.tokens_seen += out["tokens"]
            seconds = time.perf_counter() - t0
            last = state.step == n_steps
            metrics = _step_metrics(state.step, out, seconds, state, env) | fp8_stats
            if val_steps is not None and _due(state.step, cfg.train.eval_every, last):
                metrics["val_loss"] = evaluate(
                    model,
                    val_steps(),
                    cfg.train.eval_batches,
                    cfg.model.precision,
                    env,
                    cfg.train.eval_fp8,
                    cfg.train.loss_chunk_tokens,
                )
            logger.log(metrics)
            result.history.append(metrics)
            _count_nonfinite(state, out, cfg, logger, result.checkpoint or resumed_from)
            if pending is not None and pending.ready(env):  # an async save is written: make it a checkpoint
                result.checkpoint, pending = pending.wait(), None
            if state.nonfinite_in_row:  # never during a streak: keep_last would delete the healthy one
                continue
            if cfg.train.save_every and state.step % cfg.train.save_every == 0 and not last:
                if pending is not None:  # an async save still writing: finish it first
                    result.checkpoint = pending.wait()
                pending = save(cfg, env, model, optimizer, train_source, state)
        result.step = state.step
        if pending is not None:
            result.checkpoint = pending.wait()
        if state.nonfinite_in_row:
            logger.message(
                f"ending in a non-finite streak: no checkpoint for step {state.step}; the last one is "
                f"{result.checkpoint or resumed_from}"
            )
        else:
            result.checkpoint = save(cfg, env, model, optimizer, train_source, state).wait()
        result.hf_dir = export_final(cfg, env, model, tokenizer, result.checkpoint)
        if env.is_main and result.hf_dir is not None and tokenizer is not None:
            _check_export_tokenizer(tokenizer, result.hf_dir, logger)
    return result


def _check_export_tokenizer(tokenizer: Any, hf_dir: Path, logger: MetricsLogger) -> None:
    """Warn if ``AutoTokenizer`` on the export splits text otherwise than the run did (a passed-in tokenizer)."""
    difference = first_difference(tokenizer, load_tokenizer(hf_dir))
    if difference is not None:
        logger.message(
            f"warning: AutoTokenizer on {hf_dir} tokenizes {difference[0]!r} into {len(difference[2])} "
            f"tokens, the run's tokenizer into {len(difference[1])}: load the export's tokenizer "
            "with infir2.data.load_tokenizer(<tokenizer folder>, model_type=...) before training"
        )
