"""The model and tokenizer a stage's config names, made trainable, with a hook before sharding.

Every stage reads ``cfg.model`` / ``cfg.fp8`` / ``cfg.run`` the same way:

* ``check_model_inputs`` -- the model and tokenizer folders exist (a clear line naming the key, before
  anything is built);
* ``load_run_tokenizer`` -- the tokenizer as ``AutoTokenizer`` will read the stage's export: for the
  model's type (``from_config.arch`` or ``model_type`` in ``model.path/config.json``), so a separate
  ``model.tokenizer`` folder tokenizes as the run that made the model did;
* ``setup_model`` -- load or build the model (every token id of the tokenizer must have an embedding
  row: ``model.check_vocabulary``), fp32 masters (fp64 under ``model.precision: fp64``), the
  FP8 swap of ``fp8.recipe``, onto the device; then ``before_shard(model)`` (RL builds its rollout engine
  and reference copy there, from the whole model), then FSDP2 under torchrun.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import folder_model_type, load_tokenizer
from ..fp8 import get_recipe
from ..kernels import BACKENDS
from ..model import (
    build_from_config,
    check_experts,
    check_model_folder,
    check_vocabulary,
    check_vocabulary_rows,
    config_limits,
    load_pretrained,
    prepare_for_training,
)
from .config import StageConfig
from .distributed import DistEnv, shard_model

__all__ = ["build_model", "check_model_inputs", "load_run_tokenizer", "setup_model", "warn_router_loss"]

log = logging.getLogger(__name__)


def check_model_inputs(cfg: StageConfig) -> None:
    """``model.path`` is a model folder the FP8 recipe can convert (``model.check_experts``: its experts,
    ``fp8.high_precision_tail``), a ``model.from_config`` has blocks left below the tail, and
    ``model.tokenizer`` is a folder (each error names its key)."""
    m, recipe, tail = cfg.model, get_recipe(cfg.fp8.recipe), cfg.fp8.high_precision_tail
    if m.path:
        check_model_folder(m.path)
        if recipe.enabled:  # the conversion checked on the meta device, before any weights are read
            check_experts(m.path, recipe.name, tail=tail)
    blocks = (m.from_config or {}).get("num_hidden_layers")
    if (
        recipe.enabled
        and isinstance(blocks, int)
        and blocks > 0
        and tail
        and math.ceil(tail * blocks) >= blocks
    ):
        raise ValueError(
            f"fp8.high_precision_tail: {tail} keeps all {blocks} decoder block(s) of model.from_config in high "
            "precision (the last ceil(fraction x blocks)), nothing in low precision; lower it or add blocks"
        )
    if m.tokenizer and not Path(m.tokenizer).is_dir():
        raise FileNotFoundError(
            f"model.tokenizer: tokenizer folder not found: {m.tokenizer} (`infir2 demo "
            "--data-only --out DIR` writes a small one to DIR/tokenizer)"
        )


def _check_backend(recipe: Any, backend: str | None, device: torch.device) -> None:
    """An ``fp8.backend`` that cannot run ``recipe`` on ``device``, refused before the model is built or
    any weights are read (it was said at the conversion, after them)."""
    if backend is None or not recipe.enabled:
        return
    if why := BACKENDS[backend].why_unavailable(recipe, device):
        raise ValueError(
            f"fp8.backend: {backend} cannot run fp8.recipe {recipe.name} on {device}: {why}; leave fp8.backend "
            "out (null) for the automatic choice"
        )


def load_run_tokenizer(cfg: StageConfig) -> Any:
    """The run's tokenizer (``model.tokenizer`` or ``model.path``), read as ``AutoTokenizer`` will read the
    export: for the model's type (``from_config.arch``, or ``model_type`` in ``model.path/config.json``)."""
    path = cfg.model.tokenizer or cfg.model.path
    if not path:
        return None
    if cfg.model.from_config is not None:
        model_type = cfg.model.from_config.get("arch")
    else:
        model_type = folder_model_type(cfg.model.path) if cfg.model.path else None
    return load_tokenizer(path, model_type=model_type)


def build_model(cfg: StageConfig, tokenizer: Any) -> nn.Module:
    """The model ``cfg.model`` names: a local HF folder, or a seeded new one ``from_config``."""
    if cfg.model.path:
        return load_pretrained(cfg.model.path)
    if cfg.model.from_config:
        vocab_size = len(tokenizer) if tokenizer is not None else None
        return build_from_config(cfg.model.from_config, vocab_size=vocab_size, seed=cfg.run.seed)
    raise ValueError("model: give model.path (a local HF folder) or model.from_config")


def warn_router_loss(model: nn.Module) -> None:
    """An MoE config that asks for the router's load-balancing loss (``output_router_logits``) gets a
    warning: infir2's loss is the next-token cross-entropy alone (as transformers' own loss when the
    flag is off, the released Qwen3-MoE / Mixtral configs' setting)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        coef = getattr(config, "router_aux_loss_coef", None)
        log.warning(
            "config.json has output_router_logits: true (router_aux_loss_coef %s), but infir2 trains on "
            "the next-token loss alone: the router's load-balancing loss is not added",
            coef,
        )


def setup_model(
    cfg: StageConfig,
    env: DistEnv,
    model: nn.Module | None,
    tokenizer: Any,
    before_shard: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """``model`` (or the configured one) with fp32 masters and FP8 layers, on the device; ``before_shard``
    sees the whole model; sharded with FSDP2 if distributed."""
    if cfg.model.precision == "bf16" and env.device.type == "cpu":
        log.warning(
            "model.precision=bf16 on a CPU: most CPUs have no fast bf16 (often 10-100x slower); "
            "fp32 is the CPU baseline (--set model.precision=fp32)"
        )
    recipe = get_recipe(cfg.fp8.recipe)  # the config's name, resolved once (validated by check_shared)
    _check_backend(recipe, cfg.fp8.backend, env.device)
    where = cfg.model.tokenizer or cfg.model.path or "model.tokenizer"
    if model is None and cfg.model.path:  # the tokenizer against config.json, before any weights are read
        check_vocabulary_rows(config_limits(cfg.model.path)[0], tokenizer, where)
    model = model if model is not None else build_model(cfg, tokenizer)
    check_vocabulary(model, tokenizer, where)
    warn_router_loss(model)
    master_dtype = torch.float64 if cfg.model.precision == "fp64" else torch.float32
    model = prepare_for_training(
        model,
        recipe,
        cfg.fp8.backend,
        cfg.model.activation_checkpointing,
        cfg.model.recompute_mlp,
        master_dtype,
        cfg.fp8.high_precision_tail,
        recompute_norm=cfg.model.recompute_norm,
        mlp_saved_fp8=cfg.model.mlp_saved_fp8,
    )
    model.to(env.device)
    if before_shard is not None:
        before_shard(model)
    if not env.distributed:
        return model
    return shard_model(model, cfg.model.precision, recipe.param_gather(cfg.fp8.param_gather))
