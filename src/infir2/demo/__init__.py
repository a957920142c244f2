"""``infir2 demo``: the whole recipe on embedded data -- ``pipeline.py`` runs it, ``report.py`` writes it up,
``command.py`` is the CLI."""

from .command import add_arguments, run
from .pipeline import FULL, QUICK, DemoSettings, RecipeResult, run_demo, run_recipe

__all__ = ["FULL", "QUICK", "DemoSettings", "RecipeResult", "add_arguments", "run", "run_demo", "run_recipe"]
