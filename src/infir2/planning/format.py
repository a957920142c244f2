"""The plan's tables as ``infir2 plan`` prints them: baseline and FP8 side by side, or an RL step's terms."""

from __future__ import annotations

from .dense import Plan
from .rl import RLPlan

__all__ = ["PUBLISHED", "format_plan", "format_rl_plan"]

#: InfiR2's reported FP8 / BF16 peak memory: model -> {sequence length: ratio}.
PUBLISHED: dict[str, dict[int, float]] = {
    "qwen2.5-1.5b": {8192: 0.86, 32768: 0.89},
    "qwen2.5-7b": {8192: 0.95, 32768: 0.86},
}


ROWS = (
    "parameters",
    "gradients",
    "optimizer",
    "gathered",
    "weight_copies",
    "activations",
    "logits_saved",
    "logits_backward",
)


def format_plan(name: str, base: Plan, fp8: Plan, recipe: str, seq_len: int, device: str = "cuda") -> str:
    gib = 2**30
    where, baseline = ("per GPU (GiB)", "bf16") if device == "cuda" else ("per process (GiB)", "fp32")
    lines = [f"{where:<22}{baseline:>10}{recipe:>22}{'fp8/' + baseline:>10}"]
    for row in ROWS:
        b, f = getattr(base, row), getattr(fp8, row)
        ratio = f"{f / b:.3f}" if b else "1.000" if not f else "-"
        lines.append(f"{row:<22}{b / gib:>10.2f}{f / gib:>22.2f}{ratio:>10}")
    b, f = base.optimizer_step, fp8.optimizer_step
    lines.append(f"{'optimizer_step':<22}{b / gib:>10.2f}{f / gib:>22.2f}{(f / b if b else 1.0):>10.3f}")
    for label, attr in (("peak in backward", "backward_peak"), ("peak in the step", "step_peak")):
        b, f = getattr(base, attr), getattr(fp8, attr)
        lines.append(f"{label:<22}{b / gib:>10.2f}{f / gib:>22.2f}{f / b:>10.3f}")
    lines.append(f"{'peak':<22}{base.peak / gib:>10.2f}{fp8.peak / gib:>22.2f}{fp8.peak / base.peak:>10.3f}")
    for row in ("all_gather", "reduce_scatter"):
        lines.append(f"{row + ' /step':<22}{getattr(base, row) / gib:>10.2f}{getattr(fp8, row) / gib:>22.2f}")
    published = PUBLISHED.get(name, {}) if device == "cuda" else {}
    if published:
        rows = ", ".join(f"{ratio:.2f}x at {length // 1024}k" for length, ratio in sorted(published.items()))
        lines.append(
            f"InfiR2 published FP8/BF16 peak memory ({name}): {rows}; this plan at "
            f"{seq_len // 1024}k: {fp8.peak / base.peak:.2f}x"
        )
    return "\n".join(lines)


def format_rl_plan(p: RLPlan, device: str = "cuda") -> str:
    gib = 2**30
    u = p.update
    rows = [
        ("parameters", u.parameters),
        ("optimizer", u.optimizer),
        ("reference", p.reference),
        ("rollout engine", p.engine),
        ("rollout kv cache", p.kv_cache),
        ("rollout logits", p.rollout_logits),
        ("scoring", p.scoring),
        ("update gradients", u.gradients),
        ("update gathered", u.gathered),
        ("update weight copies", u.weight_copies),
        ("update activations", u.activations),
        ("update logits", u.logits_saved + u.logits_backward),
        ("peak in rollout", p.rollout_peak),
        ("peak in scoring", p.scoring_peak),
        ("peak in the update", p.update_peak),
        ("peak", p.peak),
    ]
    where = "per GPU (GiB)" if device == "cuda" else "per process (GiB)"
    return "\n".join([f"{where:<24}{'':>10}"] + [f"{name:<24}{value / gib:>10.2f}" for name, value in rows])
