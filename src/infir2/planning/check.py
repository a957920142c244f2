"""The check ``infir2 rl`` makes before it loads weights: does the planned step fit this device?

``warn_if_unfit(run, env, prompt_len, model_path, name)`` plans one RL step of ``run`` (an ``RLInputs``,
``rl.plan_inputs`` of the config; ``planning.rl.plan_rl``) for the shape in ``model.path``'s ``config.json``, on the run's device and world size, and when the peak is
over what one process may fill it logs ONE warning line: the run, the peak, the phase that peaks and
the limit. A warning, not a refusal: a plan is an estimate (allocated tensor bytes; no allocator
fragmentation, CUDA context or NCCL buffers), and a run over it may still fit, or not.

The limit: a GPU's memory (``torch.cuda``) times ``USABLE``, as ``infir2 plan`` counts; on a CPU the
memory available now (``MemAvailable`` of ``/proc/meminfo``) shared by the run's processes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .._dist import DistEnv
from .fit import USABLE
from .inputs import RLInputs
from .rl import RLPlan, peak_phase, plan_rl
from .shape import load_shape

__all__ = ["available_ram", "device_limit", "unfit_line", "warn_if_unfit"]

log = logging.getLogger(__name__)


def available_ram(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes of memory available to new work (``MemAvailable``), or None where there is no such file."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_limit(device: torch.device, processes: int) -> tuple[float, str] | None:
    """(bytes one process may fill, how that is named), or None when it cannot be read."""
    gib = 2**30
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total * USABLE, f"{USABLE:.0%} of this GPU's {total / gib:.1f} GiB"
    ram = available_ram()
    if ram is None:
        return None
    if processes == 1:
        return ram, "the memory available now"
    return ram / processes, f"the {ram / gib:.1f} GiB of memory available now shared by {processes} processes"


def unfit_line(name: str, p: RLPlan, limit: float, limit_name: str, device: str) -> str | None:
    """The warning for a planned step over ``limit`` bytes per process; None when it fits."""
    if p.peak <= limit:
        return None
    gib, per = 2**30, "per GPU" if device == "cuda" else "per process"
    return (
        f"{name}: the planned peak is {p.peak / gib:.1f} GiB {per}, in {peak_phase(p)}, over "
        f"{limit / gib:.1f} GiB ({limit_name}); the run goes on, but may run out of memory (a plan is an "
        "estimate: `infir2 plan --rl` shows each term)"
    )


def warn_if_unfit(
    run: RLInputs, env: DistEnv, prompt_len: int, model_path: str | None, name: str
) -> str | None:
    """Plan one step of the RL run ``run`` on ``env`` (its device and world size), prompts of
    ``prompt_len`` tokens, the shape of ``model_path``'s ``config.json``, and log one warning when its
    peak is over the device's limit (the main process only; ``name``: the run's). Returns the line, or
    None (it fits, or there is nothing to plan from)."""
    config = Path(model_path or "") / "config.json"
    if not env.is_main or not model_path or not config.is_file() or env.world_size % run.context:
        return None  # (a world size that parallel.context does not divide: the run refuses it itself)
    limit = device_limit(env.device, env.world_size)
    if limit is None:
        return None
    device = "cuda" if env.device.type == "cuda" else "cpu"
    try:
        with torch.random.fork_rng(devices=[]):  # a layer measured on the fly seeds torch: the RNG stays
            _, shape = load_shape(str(config))
            p = plan_rl(shape, run, env.world_size, max(prompt_len, 1), device)
    except (ValueError, KeyError, TypeError) as e:  # a shape the planner cannot read: no check, no stop
        log.info("no memory plan of this run (%s)", e)
        return None
    where = f"RL run {name!r} (model.path {model_path}, {env.world_size} x {device})"
    line = unfit_line(where, p, *limit, device)
    if line is not None:
        log.warning(line)
    return line
