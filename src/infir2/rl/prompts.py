"""The prompt order: a seeded permutation of the prompts file per pass, with an exact resume position."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PromptStream"]


class PromptStream:
    """Indices ``0..n-1``, a new permutation (seed + pass) every pass when ``shuffle``; ``take(k)`` the next k."""

    def __init__(self, n: int, shuffle: bool, seed: int) -> None:
        if n < 1:
            raise ValueError("the prompts file holds no prompts")
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        return torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        order = self._order()
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
            step = min(k - len(out), self.n - self.position)
            out += order[self.position : self.position + step]
            self.position += step
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["n"] != self.n:
            raise ValueError(
                f"the checkpoint's prompt order covers {state['n']} prompts, the prompts file has "
                f"{self.n}: resume with the same data.prompts_path"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
