"""A small C kernel for the CPU emulation's quantizer: one call instead of ~20 torch operations.

At the demo's sizes (a few hundred tokens x 128-512 features) an eager quantization is ~9 passes
over memory plus ~10 tiny ops on the scales, each paying torch's per-call overhead, and it costs
more than the fp32 GEMM it feeds. ``csrc/fp8_emulation.c`` does the same arithmetic in two loops
(block amax, then scale + round + write) and decodes FP8 bytes in one; its header says why each
step is bit-identical to the reference (``infir2.fp8.quantize``), and the tests check it against
the reference on every case ``fast_emulated``'s tests use.

It is built on first use with the system C compiler (``cc``, ``gcc`` or ``clang``; ~0.5 s) into
``$INFIR2_CACHE`` (default ``~/.cache/infir2``), once per CPU type and source version, and loaded
with ``ctypes``: no torch headers, no build step at install. Without a compiler, or with
``INFIR2_NATIVE=0``, :func:`available` is False and ``fast_emulated`` runs its eager torch code
(same bits, slower); the reason is logged once.

Takes contiguous fp32 tensors (partial edge blocks included); everything else is the caller's eager path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import is_fake

from .._logging import log_once

if TYPE_CHECKING:
    from ..fp8.formats import BitLayout

__all__ = ["available", "decode", "quantize", "why_unavailable"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "fp8_emulation.c"
# IEEE semantics: no fast-math, no fused multiply-add (it would round x * scale differently)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_NATIVE_ARCH = ["-march=native"]  # vector width of this machine; dropped if the compiler refuses it

_state: dict[str, object] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("INFIR2_CACHE") or Path.home() / ".cache" / "infir2") / "native"


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the CPU's feature flags (Linux), else the processor name, so
    that a cache shared between different machines (a network home) never loads a foreign build."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "").encode()
    except OSError:
        return (platform.processor() or platform.machine()).encode()


def _build() -> ctypes.CDLL:
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join(_FLAGS + _NATIVE_ARCH).encode() + platform.machine().encode() + _cpu_id()
    )
    target = _cache_dir() / f"fp8_emulation-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            errors = ""
            for arch in (_NATIVE_ARCH, []):
                result = subprocess.run(
                    [compiler, *_FLAGS, *arch, str(_SOURCE), "-o", str(built)], capture_output=True, text=True
                )
                if result.returncode == 0:
                    os.replace(built, target)  # atomic: a concurrent build writes the same file
                    break
                errors = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
            else:
                raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: {errors}")
    lib = ctypes.CDLL(str(target))
    i64, u32, f32, ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
    lib.infir2_quantize.argtypes = [
        ptr,
        i64,
        i64,
        i64,
        i64,
        f32,
        ctypes.c_int,
        u32,
        u32,
        ctypes.c_int,
        ctypes.c_int,
        ptr,
        ptr,
        ptr,
        ptr,
    ]
    lib.infir2_quantize.restype = ctypes.c_int
    lib.infir2_decode.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_int, u32, f32, u32, u32, ptr]
    lib.infir2_decode.restype = ctypes.c_int
    return lib


def why_unavailable() -> str | None:
    """Why the C kernel cannot run (None when it can); builds it on the first call."""
    if "lib" not in _state and "error" not in _state:
        if os.environ.get("INFIR2_NATIVE", "1") == "0":
            _state["error"] = "INFIR2_NATIVE=0"
        else:
            try:
                _state["lib"] = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _state["error"] = str(e)
        if "error" in _state:
            log_once(
                log, f"FP8 CPU emulation: the C kernel is off ({_state['error']}); eager torch code runs"
            )
    return _state.get("error")  # type: ignore[return-value]


def available() -> bool:
    return why_unavailable() is None


def _takes(x: torch.Tensor) -> bool:
    """A tensor the C loops can read: on the CPU, 2-D, contiguous, not empty, and with data (a fake
    tensor's, under ``FakeTensorMode``, has none: the eager code runs, making the same tensors)."""
    real = not is_fake(x)
    return real and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and x.numel() > 0


def quantize(
    x: torch.Tensor,
    bm: int,
    bk: int,
    fmax: float,
    scale_encoding: str,
    g: BitLayout,
    dtype: torch.dtype,
    kept: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(data [M,K] fp8, scale_inv [Mb,Kb] fp32, dequantized [M,K] fp32 or None)`` of fp32 ``x``
    with ``bm x bk`` blocks (resolved); ``None`` where the caller's eager path must run (not
    available, not contiguous fp32, or a NaN/inf block). ``scale_encoding``: ``"fp32"`` or ``"pow2"``;
    ``g``: the format's bit layout (``infir2.fp8.formats.bit_layout``)."""
    if scale_encoding not in ("fp32", "pow2"):
        raise ValueError(f"the C quantizer takes fp32 or pow2 scales, got {scale_encoding!r}")
    if x.dtype != torch.float32 or not _takes(x) or not available():
        return None
    m, k = x.shape
    data = torch.empty((m, k), dtype=torch.uint8)
    scales = torch.empty(
        (2, -(-m // bm), -(-k // bk)), dtype=torch.float32
    )  # scale_inv, and the scale (scratch)
    deq = torch.empty((m, k), dtype=torch.float32)  # written either way; returned when kept
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    status = lib.infir2_quantize(
        x.data_ptr(),
        m,
        k,
        bm,
        bk,
        fmax,
        int(scale_encoding == "pow2"),  # the C loop knows fp32 and pow2 scales
        g.exponent_floor,
        g.magic_offset,
        g.mbits,
        g.bias,
        scales[0].data_ptr(),
        scales[1].data_ptr(),
        data.data_ptr(),
        deq.data_ptr(),
    )
    if status:
        return None
    return data.view(dtype), scales[0], deq if kept else None


def decode(
    data: torch.Tensor, scale_inv: torch.Tensor, bm: int, bk: int, g: BitLayout
) -> torch.Tensor | None:
    """fp32 ``data * scale_inv`` of FP8 ``data`` with ``bm x bk`` blocks; ``None`` where the caller's
    eager path must run (including NaN/inf codes)."""
    if not _takes(data) or scale_inv.dtype != torch.float32 or not available():
        return None
    m, k = data.shape
    if tuple(scale_inv.shape) != (-(-m // bm), -(-k // bk)):
        return None
    scale_inv = scale_inv.contiguous()
    out = torch.empty((m, k), dtype=torch.float32)
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    status = lib.infir2_decode(
        data.data_ptr(),
        m,
        k,
        bm,
        bk,
        scale_inv.data_ptr(),
        g.shift,
        g.decode_mask & 0xFFFFFFFF,
        g.decode_factor,
        g.magnitude,
        g.nonfinite_magnitude,
        out.data_ptr(),
    )
    return None if status else out
