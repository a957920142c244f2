"""Export a checkpoint as a Hugging Face folder: BF16, FP32, or FP8 with 128x128 weight blocks.

FP8 uses the DeepSeek-V3 layout that vLLM, SGLang and transformers load: every q/k/v/o/gate/up/down
projection weight [N, K] of the decoder layers becomes float8_e4m3fn plus `<name>_scale_inv`
(float32, [ceil(N/128), ceil(K/128)], one scale per block); embeddings, lm_head, norms and biases
are written in bf16 (--base-dtype fp32 keeps an fp32 source's precision); config.json gets
quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}. The input is streamed shard by shard,
so checkpoints larger than memory convert. An FP8 folder converts back to bf16 / fp32 (dequantized).

  infir2 export --model runs/qwen2.5-7b-sft-stage2/hf --out out/model-fp8 --format fp8
  infir2 export --model Qwen2.5-7B-local --out out/qwen-fp8 --format fp8 --scale-encoding fp32
  infir2 export --model runs/qwen2.5-7b-sft-stage2/hf --out out/model-bf16 --format bf16 --max-shard-size 2GB

The projections are quantized from the source's values (an fp32 folder of a CPU run: its fp32 masters);
"dtype" in config.json names the dtype of the tensors that stay high precision.

--scale-encoding pow2 (default) rounds each block scale down to a power of two, as the training recipe
does; --scale-encoding fp32 keeps exact fp32 scales (a little more accurate). Both load the same way.

"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="input Hugging Face folder (safetensors)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", choices=["bf16", "fp32", "fp8"], default="fp8", help="default fp8")
    p.add_argument(
        "--scale-encoding",
        choices=["pow2", "fp32"],
        default=None,
        help="fp8 block scales: pow2 (power of two, as in training) or fp32 (default: pow2)",
    )
    p.add_argument(
        "--base-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="fp8: dtype of the tensors that stay high precision (embeddings, lm_head, norms, biases); "
        "default bf16, the published FP8 checkpoints' layout",
    )
    p.add_argument(
        "--whole-blocks-only",
        action="store_true",
        help="fp8: keep projections that are not whole 128x128 blocks in --base-dtype, with their fused "
        "q/k/v or gate/up siblings (transformers refuses partial blocks; vLLM needs one quantization per fused "
        "layer; docs/EVAL_EXPORT.md says which engines were shown to load what); without it they are FP8, "
        "with a warning",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out even if it is not empty (otherwise a non-empty folder is refused)",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB, 500MB (default 5GB)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from ..fp8.quantize import ScaleEncoding
    from .convert import convert_checkpoint, describe
    from .shards import parse_size

    _check_fp8_flags(args)
    encoding: ScaleEncoding = args.scale_encoding or "pow2"
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        raise ValueError(f"--max-shard-size: {e}") from None
    out = convert_checkpoint(
        args.model,
        args.out,
        fmt=args.format,
        scale_encoding=encoding,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        base_dtype=torch.float32 if args.base_dtype == "fp32" else torch.bfloat16,
        whole_blocks_only=args.whole_blocks_only,
    )
    info = describe(out)
    print(
        f"wrote {args.format} checkpoint to {Path(out)}: {info['shards']} shard(s), tensors by dtype "
        f"{info['tensors_by_dtype']}"
    )
    return 0


def _check_fp8_flags(args: argparse.Namespace) -> None:
    """The flags of --format fp8 given with another format are refused (they would be ignored)."""
    given = [
        flag
        for flag, value in (
            ("--scale-encoding", args.scale_encoding),
            ("--base-dtype", args.base_dtype),
            ("--whole-blocks-only", args.whole_blocks_only or None),
        )
        if value is not None
    ]
    if given and args.format != "fp8":
        raise ValueError(
            f"{given[0]} sets how --format fp8 is written, not --format {args.format}: drop it, or export "
            "with --format fp8"
        )
