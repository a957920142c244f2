"""Per-GPU memory and all-gather bytes of a training run, BF16 vs FP8, before you launch it.

It plans a GPU run (bf16 autocast over fp32 masters) unless ``--device cpu``: then a CPU run, per
process, as infir2 runs on CPUs (fp32 throughout, FP8 GEMMs emulated in fp32; the baseline is fp32).

``infir2 plan qwen2.5-7b --gpus 8 --seq-len 32768`` (or a Hugging Face ``config.json``) prints, per
GPU, what the run holds at its peak (the start of backward) for the BF16 baseline and the chosen FP8
recipe side by side, next to InfiR2's published FP8/BF16 peak-memory ratios where they exist:

* parameters   fp32 masters, FSDP-sharded: ``4 P / gpus``
* gradients    fp32, sharded: ``4 P / gpus``
* optimizer    AdamW moments: ``8 P / gpus`` (``--state-dtype fp32``), ``4 P / gpus`` (``bf16``) or
               ``~2.06 P / gpus`` (``fp8``: codes and a scale per 128 elements of a row)
* gathered     FSDP2 working copies (only with gpus > 1): the root module's parameters (final norm,
               lm_head, a tied embedding; the root is not resharded after forward) plus two decoder
               layers (the current one and the prefetched next), and their unsharded gradients; an
               untied embedding is an FSDP unit of its own, gathered for its forward and its backward
* weight copies what each layer's GEMMs keep for backward: autocast's bf16 casts (2 B/param) or the
               FP8 copies with their scales (blockwise 1 B/param + an fp32 scale per 128x128 block,
               nvfp4 0.5 B/param + an E4M3 scale per 16x16 block + an fp32 one per tensor), measured
               per layer by ``infir2 memory``; each lives until its layer's backward, so one layer's
               worth under activation checkpointing; ``--weight-cache step`` (``fp8.weight_cache``):
               every layer's FP8 copy for the whole step, on CUDA with its K-major transpose
* activations  per-layer bytes per token, measured by ``infir2 memory`` at the layer's shape, times
               tokens per micro-batch times layers; with activation checkpointing, each layer's fp32
               input plus one layer's full set (the one being recomputed); plus the final norm
* logits       plain loss: the fp32 log-softmax kept for backward (4 T V) and, during backward, its
               gradient and the logits' gradient (8 T V more); chunked: one ``[chunk, V]`` fp32 block
               in backward (1.5 under bf16: the head's bf16 logits, then the bf16 gradient, beside it)
* optimizer step  AdamW's temporaries during its step, when the activations are gone: torch's foreach
               AdamW on a CPU (fp32 moments) makes 4 bytes per parameter at once, the fused one on
               CUDA none, ``LowPrecisionAdamW`` three fp32 copies of the largest parameter; the peak
               is the larger of the start of backward and the step
* context      ``--context N`` (context parallelism): activations and logits of ``seq_len / N`` tokens,
               plus each layer's keys and values of the other shards, gathered and kept for attention's
               backward (every layer, or one under activation checkpointing)
* all-gather   bytes each GPU receives per optimizer step: parameters (in ``--precision``) gathered in
               forward and again for backward (the root once), per micro-batch, an FP8 recipe's
               projections as its weight cast's codes and block scales where it gathers FP8 (the
               128x128 recipes; nvfp4's need the whole tensor's amax first: gathered in ``--precision``);
               reduce-scatter of fp32 gradients

A mixture of experts (``num_experts`` / ``num_local_experts`` / ``n_routed_experts`` in the config) counts
every expert's parameters (total, and the active ones a token reads), gathers every expert's weights
(as FP8 codes with ``param_gather``), keeps every expert's FP8 weight copy, and estimates activations
from the dense layer of the active width (top-k experts + the shared one) plus the experts' extra
copies of each routed row: a lower bound (``tests/test_moe_plan.py``).

Attention is counted as the config says: ``head_dim`` where given (Qwen3's 32 heads of 128 over a hidden
size of 2048), q / k / v biases from ``attention_bias`` (else Qwen2's have them), Qwen3's per-head q / k
norms. ``qwen3-30b-a3b`` is shipped (30.53B parameters, 3.35B active). Not modelled, and said with a
warning (``unmodelled``): DeepSeek-V3's latent attention (MLA) and the dense MLP layers of an MoE
model (DeepSeek-V3's first three, Qwen-MoE's ``mlp_only_layers``): every layer is planned as an MoE
layer.

**An RL step** (``--rl CONFIG``: a shipped RL config's name or a YAML file; the model shape is the
positional model, else ``model.path``'s ``config.json``): ``rollout.batch_size`` responses generated
together, then the old / reference scoring and the update over ``algo.micro_batch_size`` sequences of
``--prompt-len`` + ``rollout.max_new_tokens`` tokens, with ``fp8.recipe``, ``model.precision``,
``model.activation_checkpointing`` and ``optim.state_dtype`` as the config says, FSDP2 over ``--gpus``.
Besides the training terms above (the update's micro-batch, its logits those of the chunked token
scorer) it counts:

* reference    the start model (``algo.kl_coef > 0`` or ``guard.max_kl``): a whole fp32 copy on every rank
* engine       the rollout engine's copy (``rollout.precision: fp8``: the FP8 export's projections, 1 byte
               per weight + a 128x128 block's fp32 scale, the rest fp32; ``bf16``: a whole fp32 copy)
* kv cache     ``rollout.batch_size`` x (``--prompt-len`` + ``max_new_tokens``) keys and values of every
               layer (bf16 on GPUs, fp32 on CPUs), plus one layer's more while it grows
* scoring      the no-grad scoring of one micro-batch: its final hidden states and two ``[chunk, V]`` fp32
               blocks of the token scorer (``loss.scorer.chunk_tokens_for``, the 256 MiB budget)
* context      ``parallel.context`` N: the update and the scoring hold ``seq / N`` tokens of each sequence
               plus the keys and values gathered from the other shards; the KV cache stays whole

The three phases peak apart (rollout: the weights, optimizer state and KV cache; scoring; the update:
the training plan), over the resident weights, the reference and the engine, and the plan says
plainly when the largest does not fit the ``--gpu`` it names.

**A training config as it is written** (``--train CONFIG``: a shipped name or a YAML file; the model shape
is the positional model, else ``model.path``'s ``config.json``): ``fp8.recipe``, ``model.precision``,
checkpointing and the SwiGLU recompute, ``optim.state_dtype`` / ``grad_dtype`` / ``fp8_block``,
``fp8.weight_cache`` and ``param_gather``, ``parallel.context``, and the tokens of a micro-batch (CPT:
``data.micro_batch_size`` x ``data.seq_len``; SFT: ``data.max_tokens_per_micro_batch``, else
``data.max_length``) come from the config; the GPUs from ``--gpus``.

Every term is an estimate of allocated tensor bytes (no allocator fragmentation, no CUDA context, no
NCCL buffers); ``tests/test_plan.py`` checks the parameter, gradient, optimizer, activation and
logits terms against bytes measured on tiny models.

    infir2 plan qwen2.5-1.5b --gpus 8 --seq-len 8192
    infir2 plan qwen2.5-7b --gpus 8 --seq-len 131072 --context 8 --activation-checkpointing
    infir2 plan qwen3-30b-a3b --gpus 8 --seq-len 32768 --activation-checkpointing --gpu h200
    infir2 plan path/to/config.json --gpus 4 --seq-len 32768 --recipe blockwise --state-dtype bf16 \\
        --activation-checkpointing --loss-chunk-tokens auto
    infir2 plan qwen2.5-7b --rl qwen2.5-7b-rl --gpus 8 --gpu h200
    infir2 plan qwen2.5-7b --train qwen2.5-7b-sft-8k-1gpu --gpus 1
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..fp8 import RECIPES, recipe_names
from ..harness.plan_settings import step_settings
from ..planning import (
    GPU_GIB,
    MEASURED,
    MODELS,
    MOE_NOTE,
    USABLE,
    WEIGHT_SCOPES,
    ModelShape,
    Plan,
    PlanInputs,
    RLPlan,
    check_context,
    context_kv_bytes,
    fit_advice,
    format_plan,
    format_rl_plan,
    layer_figures,
    load_shape,
    plan,
    plan_rl,
    plan_step,
    rl_fit,
    unmodelled,
    what_fits,
)
from ..planning.optimizer import GRAD_DTYPES, STATE_DTYPES
from ..train.config import RunConfig
from .memory import add_run_arguments

# the planner's names, where the tools, tests and benchmarks have imported them (``infir2.planning``)
__all__ = [
    "GPU_GIB",
    "MEASURED",
    "MODELS",
    "USABLE",
    "ModelShape",
    "Plan",
    "RLPlan",
    "add_arguments",
    "context_kv_bytes",
    "layer_figures",
    "load_shape",
    "plan",
    "plan_rl",
    "run",
    "unmodelled",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target_arguments(parser)
    _add_step_arguments(parser)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """What is planned (a model, an RL config's step or a train config as written) and the GPUs it must fit."""
    parser.add_argument(
        "model",
        nargs="?",
        help=f"a shipped model ({', '.join(MODELS)}) or a HF config.json / folder (with --rl: default "
        "model.path's config.json)",
    )
    parser.add_argument(
        "--rl",
        metavar="CONFIG",
        help="plan one RL step of this RL config (a shipped name such as qwen2.5-7b-rl, or a YAML file)",
    )
    parser.add_argument(
        "--train",
        metavar="CONFIG",
        help="plan one training step of this train config as it is written (a shipped name such as "
        "qwen2.5-7b-sft-8k-1gpu, or a YAML file): recipe, precision, checkpointing, moments, gradients, "
        "weight cache, tokens per micro-batch and context from the config; --gpus from the command line",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=512, help="with --rl: prompt tokens before each response"
    )
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_GIB),
        default="h100",
        help="the GPU the plan must fit (default h100, 80 GiB; a plan over 90%% of it is said, with what fits)",
    )


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's settings the plan depends on: batch, recipe, storage dtypes, parallelism, caches."""
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default: one each)"
    )
    parser.add_argument("--recipe", default="blockwise", help=f"FP8 recipe: {', '.join(RECIPES)}")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default="fp32",
        help="AdamW moments' storage (optim.state_dtype): fp32, bf16, or fp8 codes with block scales",
    )
    parser.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        default="fp32",
        help="gradients' storage (optim.grad_dtype): fp32, or bf16 (one GPU)",
    )
    parser.add_argument(
        "--loss-chunk-tokens", default="auto", help="auto | 0 (plain loss) | tokens per chunk"
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="model.precision: the dtype parameters travel in under FSDP",
    )
    add_run_arguments(
        parser,
        device_help=(
            "the run planned: cuda (GPUs, bf16 autocast; default) or cpu (fp32 emulation, per process)"
        ),
        recompute_help="without the SwiGLU recompute (model.recompute_mlp: false)",
        norm_help="without the RMSNorm recompute (model.recompute_norm: false)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=1,
        help="context parallelism (parallel.context): GPUs that share each sequence; --gpus is data x context",
    )
    parser.add_argument(
        "--no-param-gather",
        action="store_true",
        help="FP8 projections gathered in --precision, not as FP8 (fp8.param_gather: false)",
    )
    parser.add_argument(
        "--weight-cache",
        choices=WEIGHT_SCOPES,
        default="layer",
        help="fp8.weight_cache: each layer's FP8 weight copy until its backward (layer, default) or "
        "every layer's for the whole step (step)",
    )


def _chunk_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"--loss-chunk-tokens: expected auto, 0 or a number of tokens, got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"--loss-chunk-tokens must be >= 0, got {value}")
    return value


def _model_shape(model: str | None, path: str | None, flag: str) -> str:
    """The model shape to plan: the positional model, else the config's ``model.path`` folder (its
    ``config.json``); one line naming ``flag`` when neither is there."""
    if model is not None:
        return model
    folder = Path(path) if path else None
    if folder is None or not (folder / "config.json").is_file():
        raise ValueError(
            f"{flag}: model.path {path!r} has no config.json here; name the model "
            f"shape: a shipped model ({', '.join(MODELS)}) or a config.json"
        )
    return str(folder)


def run_rl(args: argparse.Namespace) -> int:
    """``infir2 plan --rl CONFIG``: one RL step of the config, on ``--gpus`` GPUs (or CPU processes)."""
    from ..rl.config import load_rl_config
    from ..rl.plan_inputs import plan_inputs
    from ..train.config import resolve_config_path

    cfg = load_rl_config(resolve_config_path(args.rl))
    inputs = plan_inputs(cfg)
    if args.gpus <= 0 or args.prompt_len <= 0:
        raise ValueError(f"--gpus and --prompt-len must be > 0, got {args.gpus} and {args.prompt_len}")
    model = _model_shape(args.model, cfg.model.path, f"--rl {args.rl}")
    context = inputs.context
    if args.gpus % context:
        raise ValueError(f"--gpus {args.gpus}: not a multiple of the config's parallel.context {context}")
    name, shape = load_shape(model)
    p = plan_rl(shape, inputs, args.gpus, args.prompt_len, args.device)
    where = f"{args.gpus} GPUs" if args.device == "cuda" else f"{args.gpus} CPU processes, fp32 emulation"
    where += f", context {context}" if context > 1 else ""
    r, a = cfg.rollout, cfg.algo
    print(
        f"{name}, RL step of {args.rl}: {shape.params / 1e9:.2f}B parameters, {where} (FSDP2), recipe "
        f"{cfg.fp8.recipe}, rollout {r.precision} x {r.batch_size} sequences of {args.prompt_len} + "
        f"{r.max_new_tokens} tokens, micro-batch {a.micro_batch_size}, reference copy "
        f"{'on' if inputs.keeps_reference else 'off'}, AC {'on' if cfg.model.activation_checkpointing else 'off'}"
    )
    print(format_rl_plan(p, args.device))
    if args.device == "cuda":
        print(rl_fit(p, args.gpu))
    return 0


def _inputs(args: argparse.Namespace) -> PlanInputs:
    """The run the flags describe, checked (one line naming the flag when not)."""
    recipe_names(args.recipe, "--recipe")  # one name, checked by get_recipe
    for key in ("gpus", "seq_len", "micro_batch"):
        if getattr(args, key) <= 0:
            raise ValueError(f"--{key.replace('_', '-')}: must be > 0, got {getattr(args, key)}")
    check_context(args.context, args.gpus, args.seq_len)
    if args.grad_dtype == "bf16" and args.gpus > 1:
        raise ValueError(
            f"--grad-dtype bf16: one GPU only (under FSDP2 each rank's gradient shard is fp32); "
            f"use --gpus 1 or --grad-dtype fp32, got --gpus {args.gpus}"
        )
    per_step = args.gpus // args.context * args.micro_batch  # sequences one forward on every GPU takes
    across = " / --context" if args.context > 1 else ""
    if args.global_batch is not None and (args.global_batch <= 0 or args.global_batch % per_step):
        raise ValueError(
            f"--global-batch {args.global_batch} is not a multiple of --gpus{across} x --micro-batch = "
            f"{per_step} (each optimizer step runs whole micro-batches on every GPU)"
        )
    chunk: int | str = (
        args.loss_chunk_tokens if args.loss_chunk_tokens == "auto" else _chunk_tokens(args.loss_chunk_tokens)
    )
    return PlanInputs(
        args.recipe,
        gpus=args.gpus,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        activation_checkpointing=args.activation_checkpointing,
        state_dtype=args.state_dtype,
        grad_dtype=args.grad_dtype,
        loss_chunk_tokens=chunk,
        precision=args.precision,
        recompute_mlp=not args.no_recompute_mlp,
        recompute_norm=not args.no_recompute_norm,
        mlp_saved_fp8=args.mlp_saved_fp8,
        param_gather=False if args.no_param_gather else None,
        device=args.device,
        context=args.context,
        weight_cache=args.weight_cache,
    )


def train_inputs(cfg: RunConfig, gpus: int, device: str, source: str) -> PlanInputs:
    """The step a train config describes, on ``gpus`` GPUs: every setting the planner models from the config.

    A CPT micro-batch is ``data.micro_batch_size`` windows of ``data.seq_len`` tokens, ``data.global_batch_size``
    of them a step; an SFT micro-batch is packed up to ``data.max_tokens_per_micro_batch`` tokens (else one
    sample of ``data.max_length``), planned as one sequence of that many tokens.
    """
    d, o = cfg.data, cfg.optim
    if d.kind == "cpt":
        seq_len, micro, global_batch = d.seq_len, d.micro_batch_size, d.global_batch_size
        per_step = gpus // cfg.parallel.context * micro
        if global_batch % per_step:
            raise ValueError(
                f"{source}: data.global_batch_size {global_batch} is not a multiple of --gpus {gpus} / "
                f"parallel.context x data.micro_batch_size = {per_step}"
            )
    else:
        seq_len, micro, global_batch = d.max_tokens_per_micro_batch or d.max_length, 1, None
    check_context(cfg.parallel.context, gpus, seq_len)
    if o.grad_dtype == "bf16" and gpus > 1:
        raise ValueError(
            f"{source}: optim.grad_dtype bf16 is for one GPU; plan it with --gpus 1, got --gpus {gpus}"
        )
    settings = step_settings(cfg.model, cfg.fp8, cfg.optim, cfg.parallel)
    return PlanInputs(
        **settings
        | {
            "precision": "fp32"
            if device == "cpu" or settings["precision"] == "fp64"
            else settings["precision"]
        },
        gpus=gpus,
        seq_len=seq_len,
        micro_batch=micro,
        global_batch=global_batch,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        param_gather=cfg.fp8.param_gather,
        device=device,
        weight_cache=cfg.fp8.weight_cache,
    )


def run_train(args: argparse.Namespace) -> int:
    """``infir2 plan --train CONFIG``: one optimizer step of a train config, on ``--gpus`` GPUs."""
    from ..train.config import load_config, resolve_config_path

    cfg = load_config(resolve_config_path(args.train))
    if args.gpus <= 0:
        raise ValueError(f"--gpus: must be > 0, got {args.gpus}")
    model = _model_shape(args.model, cfg.model.path, f"--train {args.train}")
    inputs = train_inputs(cfg, args.gpus, args.device, f"--train {args.train}")
    print(f"train config {args.train}: recipe {cfg.fp8.recipe}, model.precision {inputs.precision}")
    return _report(args, model, inputs)


def run(args: argparse.Namespace) -> int:
    if args.rl:
        return run_rl(args)
    if args.train:
        return run_train(args)
    if args.model is None:
        raise ValueError("model: name a shipped model or a config.json (or plan an RL step with --rl CONFIG)")
    return _report(args, args.model, _inputs(args))


def _report(args: argparse.Namespace, model: str, inputs: PlanInputs) -> int:
    """Print the plan of ``inputs`` for ``model``: BF16 with the same options beside the FP8 recipe, then
    BF16 as most runs train, what fits and the fewest GPUs."""
    name, shape = load_shape(model)
    experts = (
        f" ({shape.active_params / 1e9:.2f}B active: {shape.top_k} of {shape.experts} experts per layer)"
        if shape.experts
        else ""
    )
    i = inputs
    where = f"{i.gpus} GPUs" if i.device == "cuda" else f"{i.gpus} CPU processes, fp32 emulation"
    print(
        f"{name}: {shape.params / 1e9:.2f}B parameters{experts}, {where}, {i.seq_len} x {i.micro_batch} "
        f"tokens per micro-batch{f' over {i.context} context ranks' if i.context > 1 else ''}, "
        f"AC {'on' if i.activation_checkpointing else 'off'}, AdamW moments "
        f"{i.state_dtype}, gradients {i.grad_dtype}, loss chunk {i.loss_chunk_tokens}"
    )
    recipe = i.recipe
    base, fp8 = plan_step(shape, replace(i, recipe="bf16")), plan_step(shape, i)
    print(format_plan(name, base, fp8, recipe, i.seq_len, i.device))
    usual = plan_step(
        shape, replace(i, recipe="bf16", state_dtype="fp32", grad_dtype="fp32", state_expand=False)
    )
    if usual.peak != base.peak:
        print(
            f"against BF16 with fp32 moments and gradients (what most runs use): peak {usual.peak / 2**30:.2f} "
            f"GiB; this {recipe} plan {fp8.peak / usual.peak:.3f}x"
        )
    if i.device == "cuda":
        print(fit_advice(shape, i, fp8.peak, args.gpu))
        print(what_fits(shape, i, args.gpu))
    if shape.experts:
        print(MOE_NOTE)
    return 0
