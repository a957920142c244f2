"""Build or load Hugging Face causal LMs (Qwen2, Llama) for FP8 training (tokenizers: ``infir2.data``).

Precision layout of a training model:

* master weights and AdamW moments are **fp32**, always (``load_pretrained`` upcasts a bf16 checkpoint);
* ``precision="bf16"`` runs the high-precision parts (embedding, attention core, norms, ``lm_head``,
  and the projections under the ``bf16`` recipe) in bf16 autocast on top of the fp32 masters;
  ``precision="fp32"`` runs them in fp32 (the CPU baseline: CPUs without native bf16 are 7-300x
  slower in bf16); ``precision="fp64"`` keeps masters and every high-precision part in float64 and
  the emulated FP8 GEMMs accumulate in fp64: results that do not depend on a CPU's summation order
  (the golden-loss tests' reference), at several times the cost;
* the seven decoder projections run in FP8 through ``infir2.convert_to_fp8`` unless the recipe is
  ``bf16``. ``Fp8Linear`` keeps ``nn.Linear``'s parameters, so state dicts and ``save_pretrained``
  see an ordinary model.

Nothing here downloads: folders are read with ``local_files_only=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._paths import check_safetensors
from .nn import convert_to_fp8, recompute_rmsnorm, recompute_swiglu, unrecognised_experts
from .nn.moe.routing import replay_routes  # RL's trainer forwards replay the rollout's routes

if TYPE_CHECKING:
    from .fp8.recipe import Fp8Recipe

__all__ = [
    "ARCHS",
    "WEIGHT_PATTERNS",
    "autocast",
    "build_from_config",
    "check_experts",
    "check_model_folder",
    "load_pretrained",
    "prepare_for_training",
    "replay_routes",
]

#: arch name -> (transformers config class name, model class name)
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    # mixtures of experts (transformers v5: routed experts as 3-D parameters, infir2.nn.Fp8Experts in FP8)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
#: the mixtures of experts of ``ARCHS`` (their experts run in FP8)
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


#: file names that hold a Hugging Face model's weights (transformers loads any of them)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_model_folder(path: str | Path) -> Path:
    """``path`` if it is a loadable-looking HF model folder (config.json + weights); else FileNotFoundError."""
    path = Path(path)
    if path.is_file():
        raise ValueError(f"model folder {path} is a file (expected a Hugging Face model folder)")
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {path} has no config.json (expected a Hugging Face model folder)"
        )
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"model folder {path} has a config.json but no weights (expected "
            f"{' or '.join(WEIGHT_PATTERNS)}); copy them there or point at another folder"
        )
    check_safetensors(path)
    return path


def check_vocabulary(model: nn.Module, tokenizer: Any, where: str) -> None:
    """Every id ``tokenizer`` can produce has a row in ``model``'s embedding (an id past it would index
    out of range, or on some kernels read another row silently); else a ``ValueError`` naming ``where``."""
    check_vocabulary_rows(model.get_input_embeddings().num_embeddings, tokenizer, where)  # type: ignore[operator]


def check_vocabulary_rows(rows: int | None, tokenizer: Any, where: str) -> None:
    """``check_vocabulary`` against ``rows`` embedding rows (``config_limits`` reads them before a load)."""
    if rows is not None and tokenizer is not None and len(tokenizer) > rows:
        raise ValueError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows: "
            "the tokenizer is not the model's (give the tokenizer it was trained with)"
        )


def config_limits(path: str | Path) -> tuple[int | None, int | None]:
    """(embedding rows, trained positions) of the model folder ``path`` as its ``config.json`` says
    (``vocab_size``, ``max_position_embeddings``), read before any weights; None where it does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True).get_text_config()
    except Exception:  # a config transformers cannot read (any error): the load names what is wrong
        return None, None
    return getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)


def context_length(model: nn.Module) -> int | None:
    """The positions the model was trained for (``max_position_embeddings``), if its config says."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_context(model: nn.Module, tokens: int, key: str, allowed: bool = False) -> None:
    """``tokens`` per sequence fit the model's trained positions, or a ``ValueError`` naming ``key``;
    ``allowed`` (``model.beyond_context``): the user runs past them on purpose (RoPE extrapolation)."""
    check_positions(context_length(model), tokens, key, allowed)


def check_positions(limit: int | None, tokens: int, key: str, allowed: bool = False) -> None:
    """``check_context`` against ``limit`` positions (``config_limits`` reads them before a load)."""
    if limit is not None and tokens > limit and not allowed:
        raise ValueError(
            f"{key}: {tokens} tokens per sequence, but the model was trained for {limit} positions "
            "(max_position_embeddings); shorten it, or set model.beyond_context: true to run past them"
        )


def load_pretrained(path: str | Path) -> nn.Module:
    """A causal LM from a local Hugging Face folder, with fp32 weights (the training masters)."""
    from transformers import AutoModelForCausalLM

    path = check_model_folder(path)
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def build_from_config(
    config: dict[str, Any],
    vocab_size: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A freshly initialised causal LM (fp32, seeded) from ``{arch: <a name in ARCHS>, <HF config fields>}``.

    ``vocab_size`` (from the tokenizer) is used when the dict does not name one. ``device``: where the
    weights are created (and initialised, with that device's generator); default: the CPU.
    """
    import transformers

    fields = dict(config)
    arch = fields.pop("arch", None)
    if arch not in ARCHS:
        raise ValueError(f"model.from_config.arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
    if vocab_size is not None:
        fields.setdefault("vocab_size", vocab_size)
    config_cls_name, model_cls_name = ARCHS[arch]
    for key, value in fields.items():  # a negative width fails deep inside torch.empty otherwise
        if (key.endswith("_size") or key.startswith("num_")) and isinstance(value, int) and value <= 0:
            raise ValueError(f"model.from_config.{key}: must be > 0, got {value}")
    try:
        hf_config = getattr(transformers, config_cls_name)(**fields)
    except Exception as e:  # TypeError, ValueError, huggingface_hub's StrictDataclassClassValidationError
        first = " ".join(str(e).split())
        raise ValueError(f"model.from_config: {config_cls_name} rejects {fields}: {first}") from e
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else nullcontext():
        model: nn.Module = getattr(transformers, model_cls_name)(hf_config)
    return model.float()


def check_experts(path: str | Path, recipe: str, key: str = "fp8.recipe", tail: float = 0.0) -> None:
    """The FP8 ``recipe`` (a recipe with FP8) for the model folder ``path``, checked before any weights are
    read: routed experts ``convert_to_fp8`` cannot run (they would stay high precision: most of an MoE's
    GEMM weights), and whatever the conversion itself refuses (NVFP4 on routed experts, a ``tail`` that
    keeps every block high precision) are a ``ValueError`` naming ``key``, the folder and the fix. Reads
    only config.json: the module tree is built, and converted, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:  # a config transformers cannot build (any error): the load names what is wrong
        return
    if found := unrecognised_experts(skeleton):
        fqn, why = found[0]
        raise ValueError(
            f"{key}: {recipe} cannot run the MoE experts of {path} in FP8 ({fqn}: {why}; "
            f"{len(found)} such module(s)): infir2 runs the transformers v5 experts layout of "
            f"{', '.join(MOE_ARCHS)}; set {key}: bf16 to train it in high precision"
        )
    try:
        with _quiet("infir2.nn", "infir2.kernels"):  # the skeleton's conversion is not the run's
            convert_to_fp8(skeleton, recipe, high_precision_tail=tail)
    except ValueError as e:
        raise ValueError(f"{key}: {recipe} cannot run {path}: {e}") from None


@contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """The ``loggers``' records below ERROR dropped inside the block."""
    found = [logging.getLogger(name) for name in loggers]
    levels = [x.level for x in found]
    for x in found:
        x.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for x, level in zip(found, levels, strict=True):
            x.setLevel(level)


def prepare_for_training(
    model: nn.Module,
    recipe: str | Fp8Recipe = "blockwise",
    backend: str | None = None,
    activation_checkpointing: bool = False,
    recompute_mlp: bool = True,
    master_dtype: torch.dtype = torch.float32,
    high_precision_tail: float = 0.0,
    recompute_norm: bool = True,
    mlp_saved_fp8: bool = False,
) -> nn.Module:
    """fp32 (or ``master_dtype``) masters, train mode, optional activation checkpointing, the SwiGLU recompute
    (``infir2.nn.recompute_swiglu``: exact, keeps two fewer ``[T, I]`` tensors; ``mlp_saved_fp8``: keeps
    the two it saves in FP8, lossy), the RMSNorm recompute
    (``infir2.nn.recompute_rmsnorm``: exact, keeps one fewer ``[T, H]`` per norm), then the FP8 swap
    (none for a recipe without FP8, ``bf16``; the last ``high_precision_tail`` of the decoder blocks kept
    in high precision)."""
    model.to(master_dtype).train()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if activation_checkpointing:
        hf_model: Any = model
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recompute_mlp:
        recompute_swiglu(model, fp8_saved=mlp_saved_fp8)
    elif mlp_saved_fp8:
        raise ValueError("mlp_saved_fp8 keeps the SwiGLU recompute's inputs in FP8: it needs recompute_mlp")
    if recompute_norm:
        recompute_rmsnorm(model)
    convert_to_fp8(model, recipe, backend=backend, high_precision_tail=high_precision_tail)
    return model


def resolve_device(name: str, option: str = "--device") -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:N``; anything else, or a CUDA device
    this machine lacks, is a ``ValueError`` naming ``option`` (one line at the CLI, exit 2)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{option}: {name!r} is not a device (expected auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{option}: {name!r}: infir2 runs on cpu or cuda (expected auto, cpu, cuda or cuda:N)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{option} is {name} but this machine has no CUDA device (torch {torch.__version__})"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{option} is {name} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """The autocast context of the high-precision parts: bf16 autocast, or nothing for fp32 / fp64."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision in ("fp32", "fp64"):
        return nullcontext()
    raise ValueError(f"precision must be fp32, bf16 or fp64, got {precision!r}")
