"""``evaluate``: sample ``n`` completions per problem, grade them, and score avg@n / pass@k.

In-process use (the demo does this)::

    from infir2.eval import evaluate, problems_from_dicts
    problems = problems_from_dicts([{"problem": "7 * 6 = ?", "answer": "42"}], task="math")
    result = evaluate(model, tokenizer, problems, task="math", n=4, max_new_tokens=256)
    print(result.summary["avg@n"], result.markdown())
    result.save("runs/eval")        # samples.jsonl, problems.jsonl, summary.json, summary.md

By default the model runs in high precision (``precision="high"``); ``precision="recipe"`` runs the
model's ``Fp8Linear`` layers in FP8 (convert it first with ``infir2.convert_to_fp8``), both through
``infir2.nn.fp8_enabled``; ``precision="fp8"`` swaps its projections, in place, for the FP8 export's as
deployed (the words of ``generation.PRECISIONS``).

``infir2 eval`` calls ``run_evaluation(engine, ...)`` with an engine of ``generation.ENGINES`` (``builtin``:
the KV-cache engine in this process; ``server``: an OpenAI-compatible server; ``vllm``; or one
registered by name): the prompts are rendered once, the engine produces only the samples a
``CompletionLog`` lacks, and the grading, avg@n / pass@k and the report below are the same code
whichever engine produced the samples. Sample ``s`` of problem ``k`` (its place in the list) is drawn
from seed ``seed * 1_000_003 + 1009 * k + s`` whatever else is generated with it (a resumed run draws
the missing samples as the whole run would have).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX, render_prompt
from ..generation import BuiltinEngine, Engine, Prompt, Request, Sample, SamplingConfig
from ..tasks import TASKS, Problem, problems_from_dicts
from .completions import Completion, CompletionLog
from .metrics import avg_at_n, default_ks, pass_at_k

__all__ = ["EvalResult", "evaluate", "render_prompts", "run_evaluation", "sample_seed"]


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
    precision: str = "high",
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
    cfg = SamplingConfig(
        greedy=greedy,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    engine = BuiltinEngine(model, tokenizer, precision=precision)
    return run_evaluation(
        engine, tokenizer, problems, task, n, cfg, system_prompt, think_prefix, log, progress, seed
    )


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
    seed: int = 0,
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
    prompts = render_prompts(tokenizer, problems, system_prompt, think_prefix)
    done: dict[tuple[str, int], Completion] = {}
    if log is not None:
        log.check_prompts(prompts)
        done.update(log.done)
    jobs = [(k, p.id, [s for s in range(n) if (p.id, s) not in done]) for k, p in enumerate(problems)]
    jobs = [job for job in jobs if job[2]]
    fresh: list[Completion] = []

    def record(i: int, j: int, sample: Sample) -> None:
        pid, s = jobs[i][1], jobs[i][2][j]
        completion = _completion(sample, tokenizer)
        if log is not None:
            log.append(pid, s, prompts[pid], completion)
        done[(pid, s)] = completion
        fresh.append(completion)

    requests = [
        Prompt(
            tokenizer(prompts[pid], add_special_tokens=False)["input_ids"],
            prompts[pid],
            tuple(sample_seed(seed, k, s) for s in samples),
        )
        for k, pid, samples in jobs
    ]
    start = time.perf_counter()
    if requests:
        engine.generate(Request(requests, cfg, record, progress))
    seconds = time.perf_counter() - start
    if missing := [(pid, s) for _, pid, ss in jobs for s in ss if (pid, s) not in done]:
        raise RuntimeError(f"the {engine.name} engine returned no completion for {missing[:3]}")
    return _report(problems, task, n, cfg, engine, done, fresh, seconds)


def render_prompts(
    tokenizer, problems: Sequence[Problem], system_prompt: str | None, think_prefix: str
) -> dict[str, str]:
    """Each problem's prompt text by id (``data.chat.render_prompt``): what every engine is asked."""
    return {p.id: render_prompt(tokenizer, p.user_message, system_prompt, think_prefix) for p in problems}


def sample_seed(seed: int, problem: int, sample: int) -> int:
    """The seed of sample ``sample`` of the ``problem``-th problem (what a server is sent, too)."""
    return seed * 1_000_003 + 1009 * problem + sample


def _completion(sample: Sample, tokenizer) -> Completion:
    """A sample as evaluation keeps it: an engine's own text, else its ids decoded as serving engines do."""
    if sample.text is not None:
        return Completion(sample.text, sample.tokens, sample.finished)
    kept = sample.response_ids[:-1] if sample.finished else sample.response_ids
    return Completion(tokenizer.decode(kept, skip_special_tokens=True), sample.tokens, sample.finished)


def _report(
    problems: Sequence[Problem],
    task: str,
    n: int,
    cfg: SamplingConfig,
    engine: Engine,
    done: dict[tuple[str, int], Completion],
    fresh: list[Completion],
    seconds: float,
) -> EvalResult:
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
        "precision": engine.label,
        **({"dtype": dtype} if (dtype := getattr(engine, "served_dtype", None)) else {}),  # computed in
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
