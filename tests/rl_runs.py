"""What the RL tests and benchmarks share: one RL step's config and a finished run's fingerprint.

``one_step_config``: the step ``test_rl_scale.py`` counts allocations of and ``benchmarks/rl_step_memory.py``
measures -- one prompt, a group of FP8 (blockwise) rollouts that is also the micro-batch, a KL reference,
no dynamic sampling, nothing saved. ``fingerprint``: what a resumed run must equal to be the uninterrupted
run (``test_vllm_engine.py``, ``benchmarks/rl_kill_resume.py``): every metric but the timings and the
peak memory, and every tensor of the last checkpoint (model and AdamW state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def one_step_config(
    out_dir: str | Path,
    prompts: str | Path,
    name: str,
    group: int,
    max_new_tokens: int,
    kl_coef: float,
    **sections: dict[str, Any],
) -> Any:
    """An RLConfig of one step on the tiny models (fp32 high precision on CPU): one prompt of ``group``
    FP8 rollouts of up to ``max_new_tokens``, scored and updated as one micro-batch with a KL reference
    (``kl_coef``); ``sections`` add or replace keys of their section."""
    from infir2.rl import parse_rl_config

    data: dict[str, dict[str, Any]] = {
        "run": {"name": name, "out_dir": str(out_dir), "device": "cpu"},
        "model": {"precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "data": {"prompts_path": str(prompts)},
        "rollout": {
            "precision": "fp8",
            "prompts_per_step": 1,
            "group_size": group,
            "oversample_prompts": 1,
            "max_new_tokens": max_new_tokens,
            "batch_size": group,
        },
        "algo": {"dynamic_sampling": False, "kl_coef": kl_coef, "micro_batch_size": group},
        "train": {"max_steps": 1, "save_every": 0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return parse_rl_config(data, f"<one RL step {name}>")


def fingerprint(run_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """``run_dir``'s metrics without timings (``*_time_s``) and peak memory, and its last checkpoint's
    tensors by name (``model.<key>``, ``optim.<param id>.<state key>``)."""
    from infir2.checkpoint import latest_checkpoint, load_checkpoint

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in m.items() if not k.endswith(("_time_s", "peak_mem_gib"))} for m in lines]
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None, f"{run_dir}: no checkpoint"
    state = load_checkpoint(last)
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        tensors |= {f"optim.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)}
    return metrics, tensors
