"""The training loop: ``train(config) -> TrainResult``, for CPT and SFT, FP8 or BF16, 1 to N processes.

One optimizer step, top to bottom (``train_step``):

1. count the loss tokens of the whole global batch (this rank's micro-batches, summed over ranks);
2. for each micro-batch: forward (bf16 autocast or fp32 for the high-precision parts, FP8 GEMMs in
   the projections, each weight quantized once per step by ``cache_fp8_weights``), summed token
   cross-entropy, backward of ``sum_ce * world_size / n_loss_tokens`` -- so that after FSDP averages
   gradients over ranks the step's gradient is that of the per-token mean over the global batch;
3. clip the global gradient norm; if the loss or the norm is not finite, skip the update (counted,
   logged; ``train.max_nonfinite_in_row`` such steps in a row stop the run);
4. AdamW at the schedule's learning rate for this step.

Around it: evaluation every ``train.eval_every`` steps, a checkpoint every ``train.save_every``
steps and at the end, auto-resume from the run folder's latest checkpoint, and the final export
as a Hugging Face folder ``<run>/hf``. The run folder also holds ``config.yaml`` (resolved),
``metrics.jsonl`` and ``tensorboard/``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .. import checkpoint as ckpt
from ..data import load_tokenizer
from ..data.base import IGNORE_INDEX, MicroBatch, StepSource, count_loss_tokens
from ..model import autocast, build_from_config, load_pretrained, prepare_for_training
from ..nn import cache_fp8_weights, disable_fp8
from .config import RunConfig, config_to_dict, save_config
from .distributed import (
    DistEnv,
    all_reduce_sum,
    broadcast_object,
    gather_objects,
    init_distributed,
    shard_model,
)
from .loss import lm_loss_sum, use_chunked_loss
from .metrics import MetricsLogger, peak_memory_gib
from .optim import Schedule, build_optimizer, make_schedule

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


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclass
class TrainState:
    """The loop's own counters; saved under ``train_state`` in every checkpoint."""

    step: int = 0  # optimizer steps done (skipped ones included)
    tokens_seen: int = 0
    nonfinite_total: int = 0
    nonfinite_in_row: int = 0


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


def _token_ce_sum(model: nn.Module, mb: MicroBatch, precision: str, device: torch.device,
                  loss_chunk_tokens: int | str = "auto") -> torch.Tensor:  # fmt: skip
    """Summed next-token cross-entropy of one micro-batch (labels shifted here, HF convention).

    Above ``loss_chunk_tokens``' threshold the LM head + loss run chunked (``train.loss``): no full
    fp32 ``[tokens, vocab]`` logits in forward or backward.
    """
    input_ids = mb["input_ids"].to(device, non_blocking=True)
    labels = mb["labels"].to(device, non_blocking=True)
    mask = mb.get("attention_mask")
    vocab = model.get_output_embeddings().weight.shape[0]  # type: ignore[operator]
    chunk = use_chunked_loss(loss_chunk_tokens, input_ids.numel(), vocab)
    with autocast(precision, device):
        return lm_loss_sum(
            model, input_ids, labels, None if mask is None else mask.to(device), chunk, IGNORE_INDEX
        )


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
) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches, clip, and (unless non-finite) one AdamW step."""
    counts = torch.tensor(
        [count_loss_tokens(micro_batches), sum(map(_num_tokens, micro_batches))], dtype=torch.float64
    )
    n_loss_tokens, n_tokens = all_reduce_sum(counts.to(env.device), env).tolist()
    scale = env.world_size / max(n_loss_tokens, 1.0)
    ce_total = torch.zeros((), dtype=torch.float64, device=env.device)
    with cache_fp8_weights(model):
        for mb in micro_batches:
            ce_sum = _token_ce_sum(model, mb, precision, env.device, loss_chunk_tokens)
            (ce_sum * scale).backward()
            ce_total += ce_sum.detach().double()
    loss = float(all_reduce_sum(ce_total, env)) / max(n_loss_tokens, 1.0)
    grad_norm = _grad_norm(model, grad_clip)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_tokens": int(n_loss_tokens),
            "tokens": int(n_tokens), "skipped": not finite}  # fmt: skip


@torch.no_grad()
def evaluate(
    model: nn.Module, steps: Iterable[list[MicroBatch]], batches: int, precision: str, env: DistEnv,
    fp8: bool = False, loss_chunk_tokens: int | str = "auto",
) -> float:  # fmt: skip
    """Per-token loss over the first ``batches`` steps of ``steps`` (FP8 off unless ``fp8``)."""
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # [ce sum, loss tokens]
    was_training = model.training
    model.eval()
    try:
        with disable_fp8(model) if not fp8 else cache_fp8_weights(model):
            for _, micro_batches in zip(range(batches), steps, strict=False):
                for mb in micro_batches:
                    totals[0] += _token_ce_sum(model, mb, precision, env.device, loss_chunk_tokens).double()
                totals[1] += count_loss_tokens(micro_batches)
    finally:
        model.train(was_training)
    ce, n = all_reduce_sum(totals, env).tolist()
    return ce / n if n else math.nan


# --------------------------------------------------------------------------------------------
# Setup: model, data, resume


def _build_model(cfg: RunConfig, tokenizer: Any) -> nn.Module:
    if cfg.model.path:
        return load_pretrained(cfg.model.path)
    if cfg.model.from_config:
        vocab_size = len(tokenizer) if tokenizer is not None else None
        return build_from_config(cfg.model.from_config, vocab_size=vocab_size, seed=cfg.run.seed)
    raise ValueError("model: give model.path (a local HF folder) or model.from_config")


ValSteps = Callable[[], Iterable[list[MicroBatch]]]


def build_sources(cfg: RunConfig, tokenizer: Any, env: DistEnv) -> tuple[StepSource, ValSteps | None]:
    """This rank's training ``StepSource`` for ``cfg.data`` and a factory of its validation steps.

    CPT: windows of ``<train_path>/train.bin``; validation: ``<val_path or train_path>/val.bin`` in
    order, one micro-batch per step. SFT: ``SftSource`` over the JSONL (``data.epochs``, shuffled);
    validation: ``SftSource`` over ``val_path`` (one epoch, in file order).
    """
    from ..data import CptSource, SftSource, load_conversations, load_tokens, val_batches

    d = cfg.data
    if not d.train_path:
        raise ValueError("data.train_path: is required")
    seed = d.seed if d.seed is not None else cfg.run.seed
    ranks = {"rank": env.rank, "world_size": env.world_size}
    if d.kind == "cpt":
        cpt_source = CptSource(
            d.train_path, d.seq_len, d.global_batch_size, d.micro_batch_size, seed=seed, **ranks
        )
        val_dir = d.val_path or d.train_path
        if len(load_tokens(val_dir, "val")) < d.seq_len:
            log.warning(
                "%s/val.bin holds less than one window of %d tokens: no evaluation", val_dir, d.seq_len
            )
            return cpt_source, None
        max_batches = cfg.train.eval_batches * env.world_size

        def cpt_val() -> Iterable[list[MicroBatch]]:
            return ([mb] for mb in val_batches(val_dir, d.seq_len, d.micro_batch_size, max_batches, **ranks))

        return cpt_source, cpt_val
    if tokenizer is None:
        raise ValueError("model.tokenizer: SFT data needs a tokenizer (model.tokenizer or model.path)")
    if d.max_tokens_per_micro_batch is None:
        raise ValueError("data.max_tokens_per_micro_batch: required for SFT (the token budget per forward)")
    sft = {"tokenizer": tokenizer, "global_batch_size": d.global_batch_size, "max_length": d.max_length,
           "max_tokens_per_micro_batch": d.max_tokens_per_micro_batch, "overlong": d.overlong,
           "seed": seed, "progress": env.is_main, **ranks}  # fmt: skip
    train_source = SftSource(load_conversations(d.train_path), epochs=d.epochs, shuffle=d.shuffle, **sft)
    if not d.val_path:
        return train_source, None
    val_source = SftSource(load_conversations(d.val_path), epochs=1, shuffle=False, **sft)
    return train_source, _rewinding(val_source)


def _rewinding(source: StepSource) -> ValSteps:
    """Validation steps of a ``StepSource``: from its initial position at every evaluation."""
    start = source.state_dict()

    def steps() -> Iterable[list[MicroBatch]]:
        source.load_state_dict(start)
        return source

    return steps


def _total_steps(cfg: RunConfig, source: StepSource) -> int:
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    total = getattr(source, "total_steps", None)
    if total is None and hasattr(source, "__len__"):
        total = len(source)  # type: ignore[arg-type]
    if total is None:
        raise ValueError("train.max_steps: required, because the data source does not know its length")
    return int(total)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save(cfg: RunConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer, source: StepSource,
          state: TrainState) -> Path | None:  # fmt: skip
    """Gather the full state on rank 0 and write it atomically (all ranks must call)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    data_states = gather_objects(source.state_dict(), env)
    rng_states = gather_objects(_rng_state(), env)
    path = None
    if env.is_main:
        train_state = {
            **vars(state),
            "world_size": env.world_size,
            "rng": rng_states,
            "config": config_to_dict(cfg),
        }
        full = {"model": model_sd, "optimizer": optim_sd, "scheduler": {"step": state.step},
                "data": data_states, "train_state": train_state}  # fmt: skip
        path = ckpt.save_checkpoint(
            cfg.run_dir / "checkpoints", state.step, full, keep_last=cfg.train.keep_last
        )
    return broadcast_object(path, env)  # type: ignore[return-value]


def _apply_optim_config(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> None:
    """After loading optimizer state, the config's hyperparameters win (a decay-only run may change them)."""
    for i, group in enumerate(optimizer.param_groups):
        group.update(
            betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay if i == 0 else 0.0
        )


def _restore(cfg: RunConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
             source: StepSource) -> tuple[TrainState, Path | None]:  # fmt: skip
    """Resume from the run folder's latest checkpoint, else from ``load.path``; returns the counters."""
    own = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    if cfg.load.path and (cfg.load.force or own is None):
        path, mode = Path(cfg.load.path), cfg.load.mode
    elif own is not None:
        path, mode = own, "resume"
    else:
        return TrainState(), None
    full = ckpt.load_checkpoint(path)  # every rank maps the file (mmap: the page cache is shared)
    options = StateDictOptions(full_state_dict=True)
    model_sd = full["model"]
    if mode == "weights_only":
        set_model_state_dict(model, model_sd, options=options)
        log.info("loaded model weights from %s (fresh optimizer, step 0)", path)
        return TrainState(), path
    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=full["optimizer"], options=options
    )
    _apply_optim_config(optimizer, cfg)
    saved = full["train_state"]
    state = TrainState(**{k: saved[k] for k in vars(TrainState())})
    same_world = saved["world_size"] == env.world_size
    if mode == "resume":
        if not same_world:
            raise ValueError(f"checkpoint {path} was written by {saved['world_size']} processes; resuming it exactly "
                             f"needs the same number (got {env.world_size}); use load.mode=decay_only or weights_only")  # fmt: skip
        source.load_state_dict(full["data"][env.rank])
        _set_rng_state(saved["rng"][env.rank])
        log.info("resumed from %s at step %d", path, state.step)
        return state, path
    if not cfg.load.reset_data:
        if not same_world:
            raise ValueError(f"load.reset_data: checkpoint {path} has the data position of {saved['world_size']} "
                             f"processes, this run has {env.world_size}; set load.reset_data=true")  # fmt: skip
        source.load_state_dict(full["data"][env.rank])
    if cfg.load.reset_step:
        state = TrainState()
    state.nonfinite_in_row = 0
    log.info("decay-only start from %s: model + optimizer loaded, step %d, new schedule", path, state.step)
    return state, path


def _export(cfg: RunConfig, env: DistEnv, model: nn.Module, tokenizer: Any) -> Path | None:
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    if env.is_main:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.model.export_dtype or cfg.model.precision]
        out = ckpt.export_hf(model, model_sd, cfg.run_dir / "hf", tokenizer=tokenizer, dtype=dtype)
    return broadcast_object(out, env)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# The run


def _step_metrics(
    step: int, out: dict[str, Any], seconds: float, state: TrainState, env: DistEnv
) -> dict[str, Any]:
    return {"step": step, **out, "tokens_per_s": out["tokens"] / seconds if seconds > 0 else math.nan,
            "step_time_s": seconds, "tokens_seen": state.tokens_seen, "nonfinite_total": state.nonfinite_total,
            "peak_mem_gib": peak_memory_gib(env.device)}  # fmt: skip


def _count_nonfinite(state: TrainState, out: dict[str, Any], cfg: RunConfig, logger: MetricsLogger) -> None:
    if not out["skipped"]:
        state.nonfinite_in_row = 0
        return
    state.nonfinite_total += 1
    state.nonfinite_in_row += 1
    logger.message(f"step {state.step}: non-finite loss {out['loss']} or grad norm {out['grad_norm']}: update "
                   f"skipped ({state.nonfinite_in_row} in a row, {state.nonfinite_total} in total)")  # fmt: skip
    if state.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
        raise NonFiniteError(f"stopping at step {state.step}: {state.nonfinite_in_row} steps in a row had a "
                             f"non-finite loss or gradient norm (train.max_nonfinite_in_row="
                             f"{cfg.train.max_nonfinite_in_row}); lower optim.lr, check the data, or try "
                             f"another fp8.recipe. The last good checkpoint is in {cfg.run_dir / 'checkpoints'}")  # fmt: skip


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
    to its current position before every evaluation) or a function returning fresh validation steps. Under ``torchrun`` every rank calls this.
    """
    env = init_distributed(cfg.run.device)
    try:
        return _run(cfg, env, model, tokenizer, train_source, val_source, progress)
    finally:
        env.close()


def _setup_model(cfg: RunConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any) -> nn.Module:
    if cfg.model.precision == "bf16" and env.device.type == "cpu":
        log.warning("model.precision=bf16 on a CPU: most CPUs have no fast bf16 (often 10-100x slower); "
                    "fp32 is the CPU baseline (--set model.precision=fp32)")  # fmt: skip
    model = model if model is not None else _build_model(cfg, tokenizer)
    model = prepare_for_training(model, cfg.fp8.recipe, cfg.fp8.backend, cfg.model.activation_checkpointing)
    model.to(env.device)
    return shard_model(model) if env.distributed else model


def _run(cfg: RunConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any, train_source: StepSource | None,
         val_source: StepSource | ValSteps | None, progress: bool) -> TrainResult:  # fmt: skip
    run_dir = cfg.run_dir
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    tokenizer_path = cfg.model.tokenizer or cfg.model.path
    if tokenizer is None and tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
    model = _setup_model(cfg, env, model, tokenizer)
    optimizer = build_optimizer(model, cfg.optim)
    if train_source is None:
        train_source, val_steps = build_sources(cfg, tokenizer, env)
    else:
        val_steps = _rewinding(val_source) if isinstance(val_source, StepSource) else val_source
    total_steps = _total_steps(cfg, train_source)
    schedule: Schedule = make_schedule(cfg.schedule, cfg.optim.lr, total_steps)
    torch.manual_seed(cfg.run.seed + env.rank)
    random.seed(cfg.run.seed + env.rank)
    state, resumed_from = _restore(cfg, env, model, optimizer, train_source)
    result = TrainResult(run_dir, state.step, resumed_from=resumed_from)
    with MetricsLogger(
        run_dir, env.is_main, state.step, total_steps, cfg.train.log_every, progress
    ) as logger:
        steps = iter(train_source)
        while state.step < total_steps:
            t0 = time.perf_counter()
            micro_batches = next(steps, None)
            if micro_batches is None:
                logger.message(f"data exhausted after {state.step} steps (of {total_steps})")
                break
            out = train_step(model, optimizer, micro_batches, schedule(state.step), cfg.optim.grad_clip,
                             cfg.model.precision, env, cfg.train.loss_chunk_tokens)  # fmt: skip
            state.step += 1
            state.tokens_seen += out["tokens"]
            seconds = time.perf_counter() - t0
            last = state.step == total_steps
            metrics = _step_metrics(state.step, out, seconds, state, env)
            if val_steps is not None and _due(state.step, cfg.train.eval_every, last):
                metrics["val_loss"] = evaluate(model, val_steps(), cfg.train.eval_batches,
                                               cfg.model.precision, env, cfg.train.eval_fp8,
                                               cfg.train.loss_chunk_tokens)  # fmt: skip
            logger.log(metrics)
            result.history.append(metrics)
            _count_nonfinite(state, out, cfg, logger)
            if cfg.train.save_every and state.step % cfg.train.save_every == 0 and not last:
                result.checkpoint = _save(cfg, env, model, optimizer, train_source, state)
        result.step = state.step
        result.checkpoint = _save(cfg, env, model, optimizer, train_source, state)
        result.hf_dir = _export(cfg, env, model, tokenizer)
    return result
