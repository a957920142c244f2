"""Write Hugging Face checkpoint folders: BF16 / FP32, or FP8 in the DeepSeek-V3 layout (``layout.py``).

Two entry points share one per-tensor conversion:

* ``export_model(model, tokenizer, out_dir, fmt)`` - an in-memory model (e.g. right after training), or
  its config with a stream of ``(name, tensor)`` pairs (``tensors=``: a sharded training checkpoint read
  one tensor at a time, so the whole model is never in one process's memory);
* ``convert_checkpoint(src_dir, out_dir, fmt)`` - an existing HF folder (the authors' ``bf16_cast_fp8``),
  streamed shard by shard (``safe_open``), so a model larger than memory converts; an FP8 folder of
  this layout converts back to BF16 / FP32 the same way (dequantized).

The output folder holds ``model-0000i-of-0000n.safetensors`` shards (one: ``model.safetensors``), ``model.safetensors.index.json``,
``config.json`` (``dtype``; ``quantization_config`` for FP8), ``generation_config.json`` and the tokenizer.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .._paths import check_safetensors, make_folder
from ..data.chat import stop_token_ids
from ..fp8.quantize import ScaleEncoding
from .agree import check_config_agrees
from .hf_keys import checkpoint_tensors, fp8_weight_names, modules_to_not_convert
from .layout import (
    QUANTIZATION_CONFIG,
    SCALE_SUFFIX,
    dequantize_weight,
    export_scale_encoding,
    is_fp8_config,
    is_projection_weight,
    quantize_weight,
    scale_inv_name,
)
from .partial import PARTIAL_BLOCK_LOADERS, PartialBlocks, fused_group
from .shards import INDEX_NAME, CheckpointReader, ShardWriter

__all__ = [
    "FORMATS",
    "PARTIAL_BLOCK_LOADERS",
    "convert_checkpoint",
    "describe",
    "export_model",
    "fused_group",
]

log = logging.getLogger(__name__)

FORMATS = ("bf16", "fp32", "fp8")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _convert_tensors(
    names: Iterable[str],
    get: Callable[[str], torch.Tensor],
    fmt: str,
    scale_encoding: ScaleEncoding,
    base_dtype: torch.dtype,
    is_fp8: Callable[[str, torch.Tensor], bool] = is_projection_weight,
    partial: PartialBlocks | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per tensor: dequantize an FP8 source weight, then cast (bf16/fp32) or quantize the tensors
    ``is_fp8`` names (fp8; default: the decoder projections by name) from the source's own precision (the
    fp32 masters of a CPU run), and cast the rest to ``base_dtype``; ``partial`` records (and may keep in
    ``base_dtype``) the FP8 weights with partial blocks."""
    for name in names:
        if name.endswith(SCALE_SUFFIX):
            continue  # consumed together with its weight
        tensor = get(name)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_weight(tensor, get(scale_inv_name(name)), torch.float32)
        if fmt == "fp8":
            if is_fp8(name, tensor) and (partial is None or partial.check(name, tensor)):
                data, scale_inv = quantize_weight(tensor, scale_encoding)
                yield name, data
                yield scale_inv_name(name), scale_inv
            else:
                yield name, _cast(tensor, base_dtype)  # embeddings, lm_head, norms, biases
        else:
            yield name, _cast(tensor, _DTYPES[fmt])


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _check_base_dtype(base_dtype: torch.dtype) -> None:
    if base_dtype not in _DTYPE_NAMES:
        raise ValueError(f"base_dtype must be one of {sorted(map(str, _DTYPE_NAMES))}, got {base_dtype}")


def _patch_config(
    path: Path,
    fmt: str,
    dtype_name: str,
    architecture: str | None = None,
    not_converted: list[str] | None = None,
) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    if architecture and not config.get("architectures"):  # a model built from a config has none
        config["architectures"] = [architecture]  # serving engines (vLLM, transformers serve) need it
    config.pop("quantization_config", None)
    if fmt == "fp8":
        config["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
        if not_converted:  # what stayed high precision, so that loaders do not expect FP8 there
            config["quantization_config"]["modules_to_not_convert"] = not_converted
    config["dtype"] = dtype_name
    if "torch_dtype" in config:  # older transformers spell it this way
        config["torch_dtype"] = dtype_name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------ in-memory model


def _architecture(model: torch.nn.Module) -> str | None:
    """The transformers class name of ``model`` (FSDP2 wraps it in a subclass ``FSDP<name>``)."""
    return next((c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{tied name: the name it is tied to}`` when the model's config ties them, else empty."""
    config: Any = getattr(model, "config", None)
    tied_map = getattr(model, "_tied_weights_keys", None)
    return (
        dict(tied_map) if isinstance(tied_map, dict) and getattr(config, "tie_word_embeddings", False) else {}
    )


def _unique_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second name of tied tensors (e.g. ``lm_head.weight`` tied to the embedding).

    Ties are seen as shared storage (a live ``model.state_dict()``) or, for a gathered copy (FSDP's full
    state dict holds separate tensors), from the model's own map of tied keys when its config ties them.
    """
    tied = _tied_names(model)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        source = tied.get(name)
        tied_to_earlier = source is not None and source in state and torch.equal(state[source], t)
        if (key in seen and t.numel() > 0) or tied_to_earlier:
            log.info("export: %s is tied to an earlier tensor; not stored twice", name)
            continue
        seen.add(key)
        out[name] = t
    return out


def export_model(
    model: torch.nn.Module,
    tokenizer,
    out_dir: str | Path,
    fmt: str = "bf16",
    scale_encoding: ScaleEncoding = "pow2",
    base_dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = "5GB",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    overwrite: bool = False,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Save an in-memory HF causal LM as a ``fmt`` folder; for ``fp8`` the other tensors are in ``base_dtype``.

    ``state_dict`` (default: ``model.state_dict()``) is what is written -- the training loop passes the
    full state dict gathered from FSDP shards; ``model`` supplies the config. ``tensors`` (instead of
    ``state_dict``) streams ``(name, tensor)`` pairs: each is converted and handed to the shard writer
    before the next is read (a tied name of the config is skipped). The generation config
    stops at ``<|im_end|>`` and the eos token, so inference engines stop where ``infir2 eval`` does.
    ``tokenizer`` may be None (no tokenizer files are written then). A folder that already holds a
    checkpoint is an error unless ``overwrite`` (then it is replaced). The files are written next to
    ``out_dir`` first and renamed into place, so a new folder appears whole or not at all.
    ``scale_encoding`` (fp8): ``pow2`` block scales, as the training recipe, or ``fp32``.
    """
    _check_format(fmt)
    scale_encoding = export_scale_encoding(scale_encoding)
    config: Any = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"cannot export a {type(model).__name__}: expected a transformers model with a .config"
        )
    _check_base_dtype(base_dtype)
    out = Path(out_dir)
    if not overwrite and out.is_dir() and ((out / INDEX_NAME).exists() or any(out.glob("*.safetensors"))):
        raise ValueError(f"output folder {out} already holds a checkpoint; choose a new or empty folder")
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if tensors is not None and state_dict is not None:
        raise ValueError("export_model: give state_dict or tensors, not both")
    writer = ShardWriter(tmp, max_shard_size)
    cast = base_dtype if fmt == "fp8" else _DTYPES[fmt]

    def prepared(t: torch.Tensor) -> torch.Tensor:  # fp8: cast after quantizing (_convert_tensors)
        t = t.detach().cpu()
        return t if fmt == "fp8" else _cast(t, cast)

    partial = PartialBlocks()
    if tensors is None:
        state = _unique_state_dict(model, model.state_dict() if state_dict is None else state_dict)
        state, fp8 = checkpoint_tensors(model, state)  # the checkpoint layout (per-expert weights)
        getter = lambda name: prepared(state[name])  # noqa: E731
        stream = _convert_tensors(state, getter, fmt, scale_encoding, cast, _member_of(fp8), partial)
    else:
        stream = _convert_stream(tensors, model, prepared, fmt, scale_encoding, cast)
    for name, tensor in tqdm(stream, desc=f"export {fmt}", unit="tensor"):
        writer.add(name, tensor)
    writer.close()
    partial.report()
    _inference_config(config, tokenizer).save_pretrained(tmp)
    _patch_config(
        tmp / "config.json", fmt, _DTYPE_NAMES[cast], _architecture(model), modules_to_not_convert(model)
    )
    _save_generation_config(model, tokenizer, tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _move_into_place(tmp, out, overwrite)
    log.info("exported %s checkpoint to %s", fmt, out)
    return out


def _convert_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    model: torch.nn.Module,
    prepared: Callable[[torch.Tensor], torch.Tensor],
    fmt: str,
    scale_encoding: ScaleEncoding,
    base_dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``_convert_tensors`` over a stream: one source tensor at a time (tied names skipped), each in the
    checkpoint layout (a fused expert tensor becomes its per-expert tensors)."""
    tied, fp8_names = _tied_names(model), fp8_weight_names(model)
    for name, tensor in tensors:
        if name in tied:
            log.info("export: %s is tied to %s; not stored twice", name, tied[name])
            continue
        parts, fp8 = checkpoint_tensors(model, {name: prepared(tensor)}, fp8_names)
        yield from _convert_tensors(
            parts, parts.__getitem__, fmt, scale_encoding, base_dtype, _member_of(fp8)
        )


def _member_of(names: set[str]) -> Callable[[str, torch.Tensor], bool]:
    """The ``is_fp8`` test of ``_convert_tensors`` for a set of tensor names."""
    return lambda name, _tensor: name in names


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """fsync the files of ``tmp``, then rename it to ``out``; into an existing folder, file by file."""
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if overwrite and out.exists():
        shutil.rmtree(out)
    if not out.exists():
        tmp.rename(out)
        return
    for path in tmp.iterdir():  # an existing folder without a checkpoint (checked first): files added
        path.replace(out / path.name)
    tmp.rmdir()


def _inference_config(config: Any, tokenizer) -> Any:
    """``config`` as an inference engine reads it: the KV cache on (training turns it off) and the
    tokenizer's own bos token (or none); ``_patch_config`` adds ``architectures``."""
    config = copy.deepcopy(config)
    if hasattr(config, "use_cache"):
        config.use_cache = True
    if tokenizer is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config


def _save_generation_config(model: torch.nn.Module, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    gen = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
    if tokenizer is not None:
        stops = stop_token_ids(tokenizer)  # where `infir2 eval` stops too
        if stops:
            gen.eos_token_id = stops
        if tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
        gen.bos_token_id = tokenizer.bos_token_id
    gen.save_pretrained(out)


# ----------------------------------------------------------------------------------- folder -> folder

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def _check_folders(src: Path, out: Path, fmt: str, overwrite: bool) -> None:
    """``convert_checkpoint``'s refusals before anything is written: the source a HF folder (not already
    FP8 when converting to FP8), the output new or empty (or ``overwrite``) and apart from the source."""
    config_path = src / "config.json"
    if not src.is_dir():
        raise FileNotFoundError(f"model folder {src} does not exist")
    if not config_path.is_file():
        raise FileNotFoundError(f"{src}: no config.json (expected a Hugging Face checkpoint folder)")
    check_safetensors(src)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if src.resolve() == out.resolve():
        raise ValueError(f"output folder {out} is the input folder; choose another")
    if out.resolve() in src.resolve().parents:
        raise ValueError(f"output folder {out} contains the input folder {src}; choose another")
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"output folder {out} is not empty; choose a new or empty folder, or pass --overwrite "
            "to replace it"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if fmt == "fp8" and is_fp8_config(config, str(config_path)):
        raise ValueError(f"{src} is already an FP8 checkpoint")


def convert_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "fp8",
    scale_encoding: ScaleEncoding = "pow2",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    base_dtype: torch.dtype = torch.bfloat16,
    whole_blocks_only: bool = False,
) -> Path:
    """Convert a safetensors HF folder to ``fmt``, one input shard in memory at a time.

    ``fp8``: the projections are quantized from the source's own values (an fp32 folder: its fp32
    masters), every other floating tensor (embeddings, lm_head, norms, biases) is written in
    ``base_dtype`` -- bf16 by default, the layout of the published FP8 checkpoints; ``torch.float32``
    keeps an fp32 source's precision -- and ``config.json`` names that dtype.
    All other top-level files (tokenizer, generation config, chat template, README) are copied.
    An FP8 source (``quantization_config`` of this layout) can be converted to ``bf16`` / ``fp32``.
    ``out_dir`` must be new or empty unless ``overwrite`` (then it is replaced); the files are
    written beside it first and renamed into place, so a failed conversion leaves it untouched.
    ``scale_encoding`` as in :func:`export_model`. ``whole_blocks_only``: projections whose shape is not
    whole 128x128 blocks (which transformers' FP8 loader refuses) stay in ``base_dtype``, with every
    projection of their fused group (q/k/v, gate/up: one quantization per layer an engine fuses), and are
    listed in ``modules_to_not_convert``; without it they are FP8 and named in a warning.
    """
    _check_format(fmt)
    _check_base_dtype(base_dtype)
    scale_encoding = export_scale_encoding(scale_encoding)
    src, out = Path(src_dir), Path(out_dir)
    _check_folders(src, out, fmt, overwrite)
    reader = CheckpointReader(src)  # its errors (no weights, a bad index) before any folder is made
    check_config_agrees(src, reader)  # config.json describes these tensors
    make_folder(out.parent, "--out")  # the folder is written beside --out and renamed into place
    final, out = out, out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    make_folder(out, "--out")  # written here first: a folder that cannot be made is one line, now
    try:
        partial = PartialBlocks(keep=whole_blocks_only)
        if whole_blocks_only and fmt == "fp8":  # the shapes first, one shard open at a time
            partial.plan(
                {
                    n: reader.shape_of(n)
                    for _, names in reader.iter_shards()
                    for n in names
                    if _fp8_candidate(reader, n)
                }
            )
        _convert_into(reader, src, out, fmt, scale_encoding, max_shard_size, base_dtype, partial)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)  # empty, or replaced with overwrite (checked above)
        elif final.exists():
            final.unlink()
        out.rename(final)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    log.info("converted %s -> %s (%s)", src, final, fmt)
    return final


def _fp8_candidate(reader: CheckpointReader, name: str) -> bool:
    """A projection weight by name and rank (``is_projection_weight`` without reading the data)."""
    return is_projection_weight(name, torch.empty(0, 0)) and len(reader.shape_of(name)) == 2


def _convert_into(
    reader: CheckpointReader,
    src: Path,
    out: Path,
    fmt: str,
    scale_encoding: ScaleEncoding,
    max_shard_size: int | str,
    base_dtype: torch.dtype,
    partial: PartialBlocks,
) -> None:
    writer = ShardWriter(out, max_shard_size)
    for _file, names in tqdm(
        reader.iter_shards(), total=len(reader.files), desc=f"convert to {fmt}", unit="shard"
    ):
        stream = _convert_tensors(names, reader.get, fmt, scale_encoding, base_dtype, partial=partial)
        for name, tensor in stream:
            writer.add(name, tensor)
    writer.close()
    partial.report()
    _copy_side_files(src, out)
    dtype_name = _DTYPE_NAMES[base_dtype if fmt == "fp8" else _DTYPES[fmt]]
    _patch_config(out / "config.json", fmt, dtype_name, not_converted=partial.modules() or None)


def _copy_side_files(src: Path, out: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and path.name != INDEX_NAME and not path.name.endswith(_WEIGHT_FILES):
            shutil.copy2(path, out / path.name)


def describe(folder: str | Path) -> dict[str, Any]:
    """Counts of tensors per dtype in a checkpoint folder (for logs and the CLI summary)."""
    reader = CheckpointReader(folder)
    counts: dict[str, int] = {}
    for _file, names in reader.iter_shards():
        for name in names:
            dtype = reader.dtype_of(name)
            counts[dtype] = counts.get(dtype, 0) + 1
    return {"shards": len(reader.files), "tensors_by_dtype": counts}
