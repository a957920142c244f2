"""``infir2 bench``: FP8 vs high precision, side by side -- quantizers, linears, a training step.

``measure.py`` holds the measurements, ``command.py`` the presets, the driver, the table and the CLI.
"""

from .command import PRESETS, SECTIONS, add_arguments, main_table, run, run_bench
from .measure import BenchConfig, StepModel, saved_bytes, step_flops

__all__ = [
    "PRESETS",
    "SECTIONS",
    "BenchConfig",
    "StepModel",
    "add_arguments",
    "main_table",
    "run",
    "run_bench",
    "saved_bytes",
    "step_flops",
]
