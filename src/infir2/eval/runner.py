"""``evaluate``: sample ``n`` completions per problem, grade them, and score avg@n / pass@k.

In-process use (the demo does this)::

    from infir2.eval import evaluate, problems_from_dicts
    problems = problems_from_dicts([{"problem": "7 * 6 = ?", "answer": "42"}], task="math")
    result = evaluate(model, tokenizer, problems, task="math", n=4, max_new_tokens=256)
    print(result.summary["avg@n"], result.markdown())
    result.save("runs/eval")        # samples.jsonl, problems.jsonl, summary.json, summary.md

By default the model runs in high precision; ``fp8=True`` runs the model's ``Fp8Linear`` layers in
FP8 (convert it first with ``infir2.convert_to_fp8``). Both through ``infir2.nn.fp8_enabled``.

``infir2 eval`` calls ``run_evaluation(engine, ...)``: the prompts are rendered once, the engine
(``LocalEngine``: transformers ``generate`` in this process; ``ServerEngine``: an OpenAI-compatible
server) produces only the samples a ``CompletionLog`` lacks, and the grading, avg@n / pass@k and
the report below are the same code whichever engine produced the samples.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..nn import fp8_enabled
from .completions import CompletionLog
from .generate import SYSTEM_PROMPT, THINK_PREFIX, Completion, SamplingConfig, generate, render_prompt
from .metrics import avg_at_n, default_ks, pass_at_k
from .server import Job, ServerConfig, server_generate
from .tasks import TASKS, Problem, problems_from_dicts

__all__ = ["Engine", "EvalResult", "LocalEngine", "ServerEngine", "evaluate", "run_evaluation"]


@dataclass
class EvalResult:
    """``summary``: one flat dict of scores and settings; ``records``: one dict per sample; ``problems``: per problem."""

    summary: dict[str, Any]
    records: list[dict[str, Any]]
    problems: list[dict[str, Any]]

    def markdown(self) -> str:
        """The summary as a two-column markdown table."""
        rows = ["| metric | value |", "|---|---|"]
        for key, value in self.summary.items():
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            rows.append(f"| {key} | {shown} |")
        return "\n".join(rows) + "\n"

    def save(self, out_dir: str | Path) -> Path:
        """Write ``samples.jsonl``, ``problems.jsonl``, ``summary.json`` and ``summary.md`` under ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, rows in (("samples.jsonl", self.records), ("problems.jsonl", self.problems)):
            with (out / name).open("w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n", encoding="utf-8")
        (out / "summary.md").write_text(self.markdown(), encoding="utf-8")
        return out


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    problems: Sequence[Problem] | Sequence[Mapping[str, Any]],
    task: str = "math",
    n: int = 1,
    greedy: bool = False,
    temperature: float = 0.65,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    batch_size: int = 8,
    fp8: bool = False,
    seed: int = 0,
    system_prompt: str | None = SYSTEM_PROMPT,
    think_prefix: str = THINK_PREFIX,
    progress: bool = True,
    log: CompletionLog | None = None,
) -> EvalResult:
    """Generate ``n`` completions per problem (greedy: ``n`` must be 1), grade them, return scores and records.

    ``problems``: ``Problem`` objects (``load_problems``) or plain dicts with the JSONL schema of ``task``.
    ``log``: a ``CompletionLog`` that keeps every finished sample (and supplies those of an earlier run).
    """
    cfg = SamplingConfig(greedy, temperature, top_p, max_new_tokens, batch_size)
    engine = LocalEngine(model, fp8=fp8, seed=seed)
    return run_evaluation(
        engine, tokenizer, problems, task, n, cfg, system_prompt, think_prefix, log, progress
    )


class Engine(Protocol):
    """Where samples come from: ``generate`` calls ``record(problem id, sample, completion)`` as each finishes."""

    name: str
    precision: str

    def generate(
        self,
        tokenizer,
        jobs: Sequence[tuple[str, int, str]],
        cfg: SamplingConfig,
        record: Callable[[str, int, Completion], None],
        progress: bool,
    ) -> None: ...


class LocalEngine:
    """``transformers`` ``generate`` on an in-process model (batched, left-padded; see ``generate.py``)."""

    name = "local"

    def __init__(self, model: torch.nn.Module, fp8: bool = False, seed: int = 0) -> None:
        self.model, self.fp8, self.seed = model, fp8, seed
        self.precision = "fp8" if fp8 else "high (fp8 disabled)"

    def generate(
        self,
        tokenizer,
        jobs: Sequence[tuple[str, int, str]],
        cfg: SamplingConfig,
        record: Callable[[str, int, Completion], None],
        progress: bool,
    ) -> None:
        torch.manual_seed(self.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            with fp8_enabled(self.model, self.fp8):
                generate(
                    self.model,
                    tokenizer,
                    [prompt for _, _, prompt in jobs],
                    cfg,
                    desc="eval",
                    progress=progress,
                    on_done=lambda i, c: record(jobs[i][0], jobs[i][1], c),
                )
        finally:
            self.model.train(was_training)


class ServerEngine:
    """An OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang, ``transformers serve``; see ``server.py``)."""

    name = "server"
    precision = "as served"

    def __init__(self, server: ServerConfig, seed: int = 0) -> None:
        self.server, self.seed = server, seed
        self.extra_body = dict(server.extra_body)  # part of the settings a resumed run must match

    def generate(
        self,
        tokenizer,
        jobs: Sequence[tuple[str, int, str]],
        cfg: SamplingConfig,
        record: Callable[[str, int, Completion], None],
        progress: bool,
    ) -> None:
        samples: dict[str, list[int]] = {}
        prompts: dict[str, str] = {}
        for pid, s, prompt in jobs:
            samples.setdefault(pid, []).append(s)
            prompts[pid] = prompt
        # a distinct seed per problem and sample, so that a server honouring "seed" reproduces a sample
        requests = [
            Job(pid, prompts[pid], tuple(ss), self.seed * 1_000_003 + 1009 * i)
            for i, (pid, ss) in enumerate(samples.items())
        ]
        for pid, s, completion in server_generate(self.server, requests, cfg, tokenizer, progress=progress):
            record(pid, s, completion)


def run_evaluation(
    engine: Engine,
    tokenizer,
    problems: Sequence[Problem] | Sequence[Mapping[str, Any]],
    task: str,
    n: int,
    cfg: SamplingConfig,
    system_prompt: str | None = SYSTEM_PROMPT,
    think_prefix: str = THINK_PREFIX,
    log: CompletionLog | None = None,
    progress: bool = True,
) -> EvalResult:
    """Render the prompts, generate the samples that ``log`` lacks with ``engine``, then score all of them.

    The scoring (grading, avg@n, pass@k, the report) is the same for every engine.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    if not problems:
        raise ValueError("no problems to evaluate")
    problems = _as_problems(problems, task)
    if wrong := [p.id for p in problems if p.task != task]:
        raise ValueError(f"problems {wrong[:3]} are not of task {task!r}")
    if n < 1 or (cfg.greedy and n != 1):
        raise ValueError(f"n must be >= 1 (and 1 with greedy decoding, which is deterministic), got {n}")
    prompts = {p.id: render_prompt(tokenizer, p.user_message, system_prompt, think_prefix) for p in problems}
    done: dict[tuple[str, int], Completion] = {}
    if log is not None:
        log.check_prompts(prompts)
        done.update(log.done)
    jobs = [(p.id, s, prompts[p.id]) for p in problems for s in range(n) if (p.id, s) not in done]
    fresh: list[Completion] = []

    def record(pid: str, sample: int, completion: Completion) -> None:
        if log is not None:
            log.append(pid, sample, prompts[pid], completion)
        done[(pid, sample)] = completion
        fresh.append(completion)

    start = time.perf_counter()
    if jobs:
        engine.generate(tokenizer, jobs, cfg, record, progress)
    seconds = time.perf_counter() - start
    if missing := [job[:2] for job in jobs if job[:2] not in done]:
        raise RuntimeError(f"the {engine.name} engine returned no completion for {missing[:3]}")
    records = []
    for p in problems:
        for s in range(n):
            c = done[(p.id, s)]
            graded = TASKS[p.task].grade(p, c.text)
            records.append(
                {
                    "id": p.id,
                    "sample": s,
                    "gold": p.answer,
                    "extracted": graded.extracted,
                    "correct": graded.correct,
                    "finished": c.finished,
                    "n_tokens": c.n_tokens,
                    "completion": c.text,
                }
            )
    per_problem = _per_problem(problems, records, n)
    summary = _summary(task, cfg, n, engine, records, per_problem)
    new_tokens = sum(c.n_tokens for c in fresh)
    summary.update(
        {
            "generated_now": len(fresh),
            "seconds": round(seconds, 2),
            "new_tokens_per_second": round(new_tokens / seconds, 1) if fresh and seconds > 0 else 0.0,
        }
    )
    return EvalResult(summary=summary, records=records, problems=per_problem)


def _as_problems(items: Sequence[Problem] | Sequence[Mapping[str, Any]], task: str) -> list[Problem]:
    if all(isinstance(p, Problem) for p in items):
        return list(items)  # type: ignore[arg-type]
    if all(isinstance(p, Mapping) for p in items):  # plain dicts with the JSONL schema
        return problems_from_dicts(items, task)  # type: ignore[arg-type]
    raise TypeError("problems must be all Problem objects or all dicts (not a mix)")


def _per_problem(problems: Sequence[Problem], records: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out = []
    for p in problems:
        rows = [r for r in records if r["id"] == p.id]
        c = sum(r["correct"] for r in rows)
        out.append(
            {
                "id": p.id,
                "gold": p.answer,
                "n": n,
                "n_correct": c,
                "accuracy": c / n,
                "n_unparsed": sum(r["extracted"] is None for r in rows),
                "answers": [r["extracted"] for r in rows],
            }
        )
    return out


def _summary(
    task: str,
    cfg: SamplingConfig,
    n: int,
    engine: Engine,
    records: list[dict[str, Any]],
    per_problem: list[dict[str, Any]],
) -> dict[str, Any]:
    counts = [p["n_correct"] for p in per_problem]
    summary: dict[str, Any] = {
        "task": task,
        "problems": len(per_problem),
        "samples_per_problem": n,
        "decoding": "greedy" if cfg.greedy else f"sample (temperature {cfg.temperature}, top_p {cfg.top_p})",
        "engine": engine.name,
        "precision": engine.precision,
        "avg@n": avg_at_n(counts, n),
    }
    for k in default_ks(n):
        summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    summary.update(
        {
            "unparseable": sum(r["extracted"] is None for r in records),
            "truncated": sum(not r["finished"] for r in records),
            "samples": len(records),
            "mean_new_tokens": sum(r["n_tokens"] for r in records) / len(records),
            "max_new_tokens": cfg.max_new_tokens,
        }
    )
    return summary
