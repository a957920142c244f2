"""``infir2 demo``: the whole recipe on embedded data -- ``pipeline.py`` runs it (every recipe at every
seed), ``results.py`` holds what it measured (``results.json``), ``summary.py`` computes the gaps and
the verdict, ``report.py`` writes it up, ``command.py`` is the CLI."""

from .command import add_arguments, run
from .pipeline import run_demo, run_recipe
from .results import FULL, QUICK, DemoRecord, DemoSettings, RecipeResult

__all__ = [  # the settings and records of results.py, the entry points of command.py and pipeline.py
    "FULL",
    "QUICK",
    "DemoRecord",
    "DemoSettings",
    "RecipeResult",
    "add_arguments",
    "run",
    "run_demo",
    "run_recipe",
]
