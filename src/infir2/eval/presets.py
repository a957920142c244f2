"""The authors' evaluation protocol as presets: task, samples per problem, token budget, sampling.

``infir2 eval --preset aime24 --data aime24.jsonl`` sets ``--task math --n 32 --max-new-tokens 31000
--temperature 0.65 --top-p 0.95``; flags given explicitly override a preset's value. The problems
are read from the user's own copy (``--data``, the JSONL schema of ``tasks.py``); nothing is
downloaded. ``docs/EVAL_EXPORT.md`` says where the public files come from and how to convert them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "Preset"]


@dataclass(frozen=True)
class Preset:
    """One benchmark of the protocol; ``problems`` is the size of the public set (a different count is warned about)."""

    task: str
    n: int
    max_new_tokens: int
    problems: int
    temperature: float = 0.65
    top_p: float = 0.95

    @property
    def samples(self) -> int:
        return self.n * self.problems

    @property
    def max_tokens(self) -> int:
        """The generated-token ceiling of the whole benchmark (every sample running to its budget)."""
        return self.samples * self.max_new_tokens


#: name -> preset (``--preset`` choices)
PRESETS: dict[str, Preset] = {
    "aime24": Preset("math", n=32, max_new_tokens=31_000, problems=30),
    "aime25": Preset("math", n=32, max_new_tokens=31_000, problems=30),
    "gpqa-diamond": Preset("multiple_choice", n=8, max_new_tokens=26_000, problems=198),
}
