"""Per-step metrics: ``metrics.jsonl`` (every step), TensorBoard, and a tqdm progress bar (rank 0 only).

Each line of ``metrics.jsonl`` is one JSON object: ``{"step": 12, "loss": ..., "lr": ..., "grad_norm": ...,
"tokens": ..., "tokens_per_s": ..., "step_time_s": ..., "peak_mem_gib": ..., "skipped": false}``,
plus ``"val_loss"`` on evaluation steps and, every ``fp8.stats_every`` steps, the FP8 telemetry
(``"fp8/<layer>/<gemm>.<operand>/<stat>"``, ``infir2.nn.telemetry``; TensorBoard tags of the same
name). On resume, lines beyond the checkpoint's step (written after it, before the interruption) are dropped, so the file always reads as one clean run.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

__all__ = ["MetricsLogger", "peak_memory_gib"]

log = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA ``max_memory_allocated``, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except ValueError:
            break  # a torn last line from a kill
    path.write_text("".join(f"{line}\n" for line in kept))


class MetricsLogger:
    """Writes metrics on the main rank; a no-op elsewhere. Use as a context manager."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        start_step: int,
        total_steps: int,
        log_every: int = 1,
        progress: bool = True,
        desc: str = "train",
    ) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file: Any = None
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        _truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=desc,
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = metrics["step"]
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(_tag(key), value, step)
        if step % self.log_every == 0 or "val_loss" in metrics:
            self._bar.set_postfix(_short(metrics), refresh=False)  # before update(), which redraws the bar
            if self._bar.disable:
                log.info("step %d %s", step, " ".join(f"{k}={v}" for k, v in _short(metrics).items()))
        self._bar.update(1)

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None and not self._bar.disable else log.warning)(text)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._tb.close()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tag(key: str) -> str:
    """The TensorBoard tag of a metric; FP8 telemetry keeps its ``fp8/<layer>/...`` key."""
    if key == "val_loss":
        return "eval/loss"
    return key if key.startswith("fp8/") else f"train/{key}"


def _short(metrics: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
        value = metrics.get(key)
        if isinstance(value, float):
            out[key] = (
                f"{value:.3g}" if math.isfinite(value) and key in ("lr", "tokens_per_s") else f"{value:.4f}"
            )
    return out
