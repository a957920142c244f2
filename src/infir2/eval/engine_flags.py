"""`infir2 eval`'s engine flags: the precision (``--precision``, the words of ``generation.PRECISIONS``)
and each engine's own (the built-in engine's, a server's, vLLM's), refused when given to another engine,
checked before anything is read, and turned into the engine they build (``EngineOptions`` and the
engine's own settings)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..generation import PRECISIONS, check_engine
from ..model import resolve_device

__all__ = [
    "IN_PROCESS_FLAGS",
    "SERVER_FLAGS",
    "VLLM_FLAGS",
    "add_engine_arguments",
    "build_eval_engine",
    "check_engine_flags",
    "check_server_flags",
    "load_model",
    "parse_extra_body",
]


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The precision flags and the flags of the built-in, server and vllm engines."""
    c = p.add_argument_group("precision (what the engine computes with)")
    c.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="high",
        help="high (default): no FP8, the model's own dtype; fp8: the FP8 export's weights as deployed "
        "(128x128 weight blocks made by the export's quantizer, 1x128 activations); recipe: a training "
        "recipe's FP8 forward through Fp8Linear layers (--recipe NAME)",
    )
    c.add_argument(
        "--recipe",
        help="--precision recipe: the training recipe (e.g. blockwise; `infir2 config --keys` lists "
        "fp8.recipe's names)",
    )
    c.add_argument(
        "--scale-encoding",
        choices=["pow2", "fp32"],
        help="--precision fp8: the export's block scales (as `infir2 export --scale-encoding`; default pow2)",
    )
    g = p.add_argument_group("builtin engine")
    g.add_argument("--batch-size", type=int, help="sequences generated together (default: 8)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    s = p.add_argument_group("server engine")
    s.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (the /v1 is added)")
    s.add_argument("--concurrency", type=int, help="requests in flight (the server batches them; default: 8)")
    s.add_argument("--request-timeout", type=float, help="seconds one request may take (default: 3600)")
    s.add_argument(
        "--retries",
        type=int,
        help="retries of a request after a connection error, timeout, 429 or 5xx (backoff 1, 2, 4 "
        "... s, at most 60; default: 8)",
    )
    s.add_argument(
        "--samples-per-request",
        type=int,
        help="samples asked for in one request (the API's n; default: all of a problem's)",
    )
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    v = p.add_argument_group("vllm engine (an in-process vllm.LLM; vLLM is an optional extra)")
    v.add_argument("--tensor-parallel-size", type=int, help="GPUs the model is split over (default: 1)")
    v.add_argument(
        "--memory-fraction", type=float, help="share of the GPU's memory vLLM takes (default: 0.5)"
    )
    v.add_argument("--cpu-kv-cache-gib", type=float, help="CPU: the KV cache in GiB (default: 1)")
    v.add_argument(
        "--max-model-len", type=int, help="longest prompt + response (default: the model's positions)"
    )
    v.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what vLLM computes in (default auto: as --engine builtin, float32 on a CPU and bfloat16 on "
        "CUDA; bfloat16 for FP8, whose activations vLLM takes in bf16)",
    )
    v.add_argument(
        "--cuda-graphs", action="store_true", help="capture CUDA graphs (default: eager, faster start)"
    )
    s.add_argument(
        "--extra-body",
        help="JSON merged into every request, for engine extensions, e.g. '{\"top_k\": -1}' (default: {})",
    )


#: each engine's own flags (dest -> default): given to an engine of the other kind, they are refused
IN_PROCESS_FLAGS: dict[str, Any] = {
    "batch_size": 8,
    "recipe": None,
    "scale_encoding": "pow2",
    "device": "auto",
    "beyond_context": False,
}


SERVER_FLAGS: dict[str, Any] = {
    "base_url": None,
    "concurrency": 8,
    "request_timeout": 3600.0,
    "retries": 8,
    "samples_per_request": None,
    "api_key": None,
    "extra_body": "{}",
}


VLLM_FLAGS = (
    "tensor_parallel_size",
    "memory_fraction",
    "cpu_kv_cache_gib",
    "max_model_len",
    "dtype",
    "cuda_graphs",
)


def _vllm_settings(args: argparse.Namespace) -> Any:
    """The vllm engine's flags as its settings; given to another engine, a flag is refused."""
    given = [d for d in VLLM_FLAGS if _given(getattr(args, d, None))]
    if args.engine != "vllm":
        if given:
            raise ValueError(f"{_flag(given[0])} is a flag of --engine vllm, not of --engine {args.engine}")
        return None
    from ..generation import vllm_engine as ve

    ve.require_vllm("--engine vllm")  # installed, before anything is read
    fp8 = (
        "--precision"
        if args.precision == "fp8"
        else "--model"
        if ve.is_fp8_folder(Path(args.model))
        else None
    )
    why = ve.fp8_unsupported() if fp8 else None
    if fp8 and why:
        raise ve.fp8_refusal(fp8, why)
    if args.device not in (None, "auto"):
        raise ValueError("--device is not a flag of --engine vllm: vLLM places the model itself")

    kept = {d: getattr(args, d) for d in VLLM_FLAGS[:-1] if getattr(args, d) is not None}
    try:
        settings = ve.VllmSettings(**kept, enforce_eager=not args.cuda_graphs)
    except ValueError as e:
        raise ValueError(f"--engine vllm: {e}") from None
    # the served dtype, known before any weights: eval's settings (a resumed run must match it)
    args.served_dtype, how = ve.served_dtype(settings, fp8 is not None)
    auto = how if settings.dtype == "auto" else ""
    ve.check_served_dtype(args.served_dtype, fp8 is not None, "--dtype", ve.supported_dtypes(), auto)
    args.vllm_precision = ve.vllm_precision_label(fp8 is not None)
    return settings


def _given(value: Any) -> bool:
    """A flag was given: not its unset ``None`` nor a switch left off. A value of 0 is a value given
    (``0 in (None, False)`` is true in Python: ``--tensor-parallel-size 0`` passed for not given)."""
    return value is not None and value is not False


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of another kind of engine (``TRAITS``: an in-process engine's --batch-size, --recipe,
    --scale-encoding, --device, --beyond-context; a server's --base-url, --concurrency ...), what the
    engine cannot run (``check_engine``: --precision fp8 on a server) and a --recipe or --scale-encoding
    without its precision, in one line naming the flag, before anything is read; then fill the defaults
    of the flags not given."""
    traits = check_engine(args.engine, "--engine", args.precision, "--precision")
    args.vllm_settings = _vllm_settings(args)
    given = [d for d in (*IN_PROCESS_FLAGS, *SERVER_FLAGS) if _given(getattr(args, d))]
    for dest in given:
        server_flag = dest in SERVER_FLAGS
        if traits is not None and server_flag == traits.in_process:
            kind = "--engine server" if server_flag else "an in-process engine (--engine builtin)"
            raise ValueError(f"{_flag(dest)} is a flag of {kind}, not of --engine {args.engine}")
    if args.precision == "recipe" and args.recipe is None:
        raise ValueError(
            "--precision recipe needs --recipe NAME (`infir2 config --keys` lists fp8.recipe's names)"
        )
    if args.recipe is not None and args.precision != "recipe":
        raise ValueError(
            f"--recipe names the training recipe of --precision recipe, not of --precision {args.precision}"
        )
    if args.scale_encoding is not None and args.precision != "fp8":
        raise ValueError(
            "--scale-encoding sets the block scales of --precision fp8: give it with --precision fp8"
        )
    for dest, default in (*IN_PROCESS_FLAGS.items(), *SERVER_FLAGS.items()):
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def load_model(args: argparse.Namespace):
    """The model of --model; with --precision recipe its projections converted to ``Fp8Linear``."""
    from ..export import load_checkpoint

    device = str(resolve_device(args.device))
    model = load_checkpoint(args.model, device=device)
    if args.precision == "recipe":
        from ..nn import convert_to_fp8

        convert_to_fp8(model, args.recipe)  # an unknown recipe name is a ValueError naming the choices
    return model


def build_eval_engine(args: argparse.Namespace, tokenizer):
    """The engine of --engine: the options every engine takes, and the engine's own settings (a server's
    and vllm's from their flags; the others' defaults)."""
    from ..generation import EngineOptions, build_engine

    options = EngineOptions(
        tokenizer,
        model=lambda: load_model(args),
        precision=args.precision,
        scale_encoding=args.scale_encoding,
        model_dir=str(args.model),
    )
    own = {"server": _server_config(args) if args.base_url else None, "vllm": args.vllm_settings}
    return build_engine(args.engine, options, own.get(args.engine))


def check_server_flags(args: argparse.Namespace) -> None:
    """The server engine's flags, before anything is loaded."""
    if args.engine != "server":
        return
    if not args.base_url:
        raise ValueError("--engine server needs --base-url (e.g. http://127.0.0.1:8000)")
    parse_extra_body(args)
    if args.tokenizer is None and not Path(args.model).is_dir():
        raise ValueError(
            f"--engine server needs --tokenizer FOLDER to render the prompts (--model {args.model!r} "
            f"is the served name, not a folder)"
        )


def parse_extra_body(args: argparse.Namespace) -> dict[str, Any]:
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e.msg}): {args.extra_body!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    return extra


#: the server engine's flags -> the fields of its settings (``ServerConfig``)
_SERVER_FIELDS = {
    "concurrency": "concurrency",
    "request_timeout": "timeout_s",
    "retries": "retries",
    "samples_per_request": "samples_per_request",
    "api_key": "api_key",
}


def _server_config(args: argparse.Namespace):
    from ..generation import ServerConfig

    own = {field: getattr(args, dest) for dest, field in _SERVER_FIELDS.items()}
    return ServerConfig(args.base_url, args.model, extra_body=parse_extra_body(args), **own)
