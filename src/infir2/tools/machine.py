"""What a measurement ran on: the CPU's model and the vector extensions its speed and its rounding
depend on, the core count and torch's version. One line, printed by every benchmark and stored by the
demo, so that each figure names its machine (CONTRIBUTING.md)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpu_description", "machine_description"]

#: what the speed and the rounding of a CPU GEMM depend on
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str | None = None) -> str:
    """``"AMD EPYC (avx2, avx512f, avx512_bf16; no amx_bf16)"``: the CPU model and its vector extensions,
    from ``/proc/cpuinfo`` (Linux; the model ``lscpu`` prints); the platform's processor name elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return platform.processor() or platform.machine()
    fields_ = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields_ = {k.strip(): v.strip() for k, v in fields_.items()}
    model = fields_.get("model name") or platform.processor() or platform.machine()
    flags = set(fields_.get("flags", "").split())
    have = [f for f in ISA_FLAGS if f in flags]
    lack = [f for f in ISA_FLAGS if f not in flags]
    return f"{model} ({', '.join(have) or 'none of ' + '/'.join(ISA_FLAGS)}{'; no ' + ', '.join(lack) if lack else ''})"


def machine_description(threads_per_run: int | None = None) -> str:
    """``"2 CPUs, AMD EPYC (avx2, ...), 1 thread per run, torch <version>"``: what a run was measured on."""
    import torch

    threads = f", {threads_per_run} thread(s) per run" if threads_per_run else ""
    return f"{os.cpu_count()} CPUs, {cpu_description()}{threads}, torch {torch.__version__}"
