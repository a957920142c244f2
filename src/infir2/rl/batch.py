"""What an RL step trains on, typed: a ``Group`` per prompt, an ``RLBatch`` of padded tensors per step.

* ``Group`` -- one prompt's sampled responses, graded: lengths, finished flags, correctness, shaped
  rewards and, for a group dynamic sampling keeps, the response ids and the rollout engine's
  log-probabilities (``[n, R]`` float32, right-padded). Ranks all-gather groups (the log-probabilities
  travel as one tensor each, not as Python floats); the dynamic-sampling buffer saves them as plain
  records (``to_record`` / ``from_record``, which refuses a record of another layout);
* ``RLBatch`` -- the step's samples (one row per response) as padded tensors, built once per step:
  prompts left-padded ``[B, P]``, responses right-padded ``[B, R]``, the rollout / old / reference
  log-probabilities and TIS weights ``[B, R]`` (zero past each response), advantages ``[B]`` and whether a
  row counts in the loss, and with routing replay the experts the engine chose per token and MoE layer
  (``routes`` ``[B, P + R, layers, k]`` int16, ``-1`` where none was recorded). ``rows(idx)`` slices a micro-batch trimmed to its own widths -- the tensors
  the trainer's forward would get from those samples alone, so the numerics do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..generation import left_pad

__all__ = ["Group", "RLBatch", "Rows"]


#: the keys of every ``Group`` record (a kept group's adds ``responses`` and ``logprobs``)
RECORD_KEYS = ("prompt", "lengths", "finished", "correct", "rewards")


@dataclass
class Group:
    """One prompt's sampled and graded responses (``responses`` / ``logprobs`` None: a dropped group)."""

    prompt: int
    lengths: list[int]
    finished: list[bool]
    correct: list[float]
    rewards: list[float]
    responses: list[list[int]] | None = None
    logprobs: torch.Tensor | None = None  # [n, max length] float32, zero past each response
    routes: list[torch.Tensor] | None = None  # routing replay: per response [P + length, layers, k] int16

    @property
    def kept(self) -> bool:
        return self.responses is not None

    def response_logprobs(self, j: int) -> torch.Tensor:
        assert self.logprobs is not None
        return self.logprobs[j, : self.lengths[j]]

    def to_record(self) -> dict[str, Any]:
        """Plain data for a checkpoint (``torch.load(weights_only=True)`` reads it)."""
        record: dict[str, Any] = {
            "prompt": self.prompt,
            "lengths": self.lengths,
            "finished": self.finished,
            "correct": self.correct,
            "rewards": self.rewards,
        }
        if self.responses is not None:
            record["responses"] = self.responses
            record["logprobs"] = [self.response_logprobs(j).tolist() for j in range(len(self.lengths))]
            if self.routes is not None:
                record["routes"] = self.routes
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Group:
        """A record of ``to_record``; one of another layout is a ``ValueError`` naming what it lacks (no
        release of infir2 has been made, so no older record is read)."""
        needed = RECORD_KEYS + (("logprobs",) if "responses" in record else ())
        missing = [key for key in needed if key not in record]
        if missing:
            raise ValueError(
                f"a dynamic-sampling buffer record has no {', '.join(missing)} (it holds "
                f"{', '.join(sorted(record))}): a layout this version does not read"
            )
        responses = record.get("responses")
        lengths = record["lengths"]
        logprobs = None
        if responses is not None:
            logprobs = pad_rows([torch.tensor(lp, dtype=torch.float32) for lp in record["logprobs"]])
        return cls(
            record["prompt"],
            list(lengths),
            list(record["finished"]),
            list(record["correct"]),
            list(record["rewards"]),
            responses,
            logprobs,
            record.get("routes"),
        )


def pad_rows(rows: list[torch.Tensor], width: int | None = None, value: float = 0.0) -> torch.Tensor:
    """1-D tensors right-padded with ``value`` to ``width`` (default: the longest) and stacked."""
    width = max((r.numel() for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


@dataclass
class Rows:
    """A micro-batch of an ``RLBatch``: its rows trimmed to their longest prompt and response."""

    ids: torch.Tensor  # [m, P + R]: prompt left-padded, response right-padded
    attention_mask: torch.Tensor  # [m, P + R]
    response_mask: torch.Tensor  # [m, R] float
    prompt_width: int
    rollout_logp: torch.Tensor  # [m, R]
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    tis: torch.Tensor
    adv: torch.Tensor  # [m] float64
    keep: torch.Tensor  # [m] bool
    index: torch.Tensor  # [m] the rows' indices in the batch
    routes: torch.Tensor | None = None  # [m, P + R, layers, k] int16 (routing replay), -1: route afresh


@dataclass
class RLBatch:
    """A step's samples as padded tensors (module docstring); ``old_logp`` / ``ref_logp`` / ``tis`` are
    filled by the step's scoring pass."""

    prompt_ids: torch.Tensor  # [B, P] left-padded with pad_id
    prompt_len: torch.Tensor  # [B]
    response_ids: torch.Tensor  # [B, R] right-padded with pad_id
    response_len: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B, R] float32
    adv: torch.Tensor  # [B] float64
    keep: torch.Tensor  # [B] bool: counts in the loss (overlong: mask drops unfinished responses)
    routes: torch.Tensor | None = None  # [B, P + R, layers, k] int16 (routing replay), -1: none recorded
    old_logp: torch.Tensor = field(init=False)
    ref_logp: torch.Tensor = field(init=False)
    tis: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.old_logp = torch.zeros_like(self.rollout_logp)
        self.ref_logp = torch.zeros_like(self.rollout_logp)
        self.tis = torch.zeros_like(self.rollout_logp)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        groups: list[Group],
        adv: torch.Tensor,
        mask_unfinished: bool,
        pad_id: int,
    ) -> RLBatch:
        """One row per response of ``groups`` (prompt ``prompts[g.prompt]``), advantages ``adv[g, j]``."""
        rows = [(g, j) for g in groups for j in range(len(g.lengths))]
        p_rows = [torch.tensor(prompts[g.prompt], dtype=torch.long) for g, _ in rows]
        r_rows = [torch.tensor(g.responses[j], dtype=torch.long) for g, j in rows]  # type: ignore[index]
        p_len = torch.tensor([p.numel() for p in p_rows])
        left, _ = left_pad([p.tolist() for p in p_rows], pad_id, torch.device("cpu"))
        return cls(
            left,
            p_len,
            pad_rows(r_rows, value=pad_id),
            torch.tensor([r.numel() for r in r_rows]),
            pad_rows([g.response_logprobs(j) for g, j in rows]),
            torch.stack([adv[gi, j] for gi, g in enumerate(groups) for j in range(len(g.lengths))]),
            torch.tensor([not (mask_unfinished and not g.finished[j]) for g, j in rows]),
            _batch_routes(rows, left.shape[1]),
        )

    @classmethod
    def of_responses(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> RLBatch:
        """One row per ``(prompts[i], responses[i])``, ungraded (advantage 0): to score given responses."""
        groups = [
            Group(i, [len(y)], [True], [0.0], [0.0], [list(y)], torch.zeros(1, len(y)))
            for i, y in enumerate(responses)
        ]
        return cls.build([list(p) for p in prompts], groups, torch.zeros(len(groups), 1), False, pad_id)

    def rows(self, index: list[int]) -> Rows:
        """The micro-batch of rows ``index``, trimmed to its own widths."""
        idx = torch.tensor(index)
        p = int(self.prompt_len[idx].max())
        r = int(self.response_len[idx].max())
        response = self.response_ids[idx, :r]
        resp_mask = (torch.arange(r)[None, :] < self.response_len[idx, None]).float()
        prompt_mask = torch.arange(p)[None, :] >= (p - self.prompt_len[idx, None])
        ids = torch.cat([self.prompt_ids[idx, -p:], response], dim=1)
        attention = torch.cat([prompt_mask.long(), resp_mask.long()], dim=1)
        sliced = {k: getattr(self, k)[idx, :r] for k in ("rollout_logp", "old_logp", "ref_logp", "tis")}
        routes = None if self.routes is None else self.routes[idx, self.prompt_ids.shape[1] - p :][:, : p + r]
        return Rows(
            ids,
            attention,
            resp_mask,
            p,
            **sliced,
            adv=self.adv[idx],
            keep=self.keep[idx],
            index=idx,
            routes=routes,
        )


def _batch_routes(rows: list[tuple[Group, int]], width: int) -> torch.Tensor | None:
    """The rows' routes ``[B, width + longest response, layers, k]`` laid out as their prompts (left-padded
    to ``width``) and responses, ``-1`` on the padding; None unless every group recorded them."""
    if not rows or any(g.routes is None for g, _ in rows):
        return None
    first = rows[0][0].routes[rows[0][1]]  # type: ignore[index]
    longest = max(g.lengths[j] for g, j in rows)
    out = torch.full((len(rows), width + longest, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (g, j) in enumerate(rows):
        own = g.routes[j]  # type: ignore[index]
        start = width - (own.shape[0] - g.lengths[j])  # the prompt's first column
        out[i, start : start + own.shape[0]] = own
    return out
