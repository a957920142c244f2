"""What a study of ``infir2 demo --rl`` (``demo/rl.py``) measured, read back: the verdicts by the demo's
interval rule, the per-pair report it prints, the figure ``OUT/rl/rl.png``, and how the projections'
FP8 and bf16 views followed the master weights over a run (``weight_views``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..paired import paired_gaps, paired_verdict
from .summary import METRICS

__all__ = ["MARGIN", "accuracy_name", "report_text", "rl_figure", "study_verdicts", "weight_views"]

MARGIN = next(m for m in METRICS if m.key == "accuracy").margin  # points: the demo's accuracy margin


def weight_views(start: Path, end: Path) -> dict[str, float]:
    """How the projections' FP8 view (the export's: 128x128 blocks, E4M3, pow2 scales; what FP8 rollouts
    and FP8 training's forward compute with) and their bf16 view followed the fp32 master weights from
    ``start`` to ``end`` (model folders): per view the share of values that changed, and the rounding
    error of its move against the master's, ``|d view - d master| / |d master|`` over all projections
    (0: the view moved as the master did; above 1: its move is mostly rounding); and ``logit_scale``, the
    mean ratio end / start of the final norm's weights (the logits' scale: sharpening moves it, and
    AdamW moves each weight by at most about lr per step)."""
    from ...export.shards import CheckpointReader
    from ...fp8.quantize import dequantize, quantize
    from ...fp8.recipe import WEIGHT_BLOCK as block

    views = {"fp8": lambda w: dequantize(*quantize(w, block), block), "bf16": lambda w: w.bfloat16().float()}
    a, b = CheckpointReader(start), CheckpointReader(end)
    move, error, changed, n = 0.0, dict.fromkeys(views, 0.0), dict.fromkeys(views, 0), 0
    scale = 1.0
    for file in a.files:
        for name in a.names_in(file):
            if name == "model.norm.weight":
                scale = float((b.get(name).float() / a.get(name).float()).mean())
            if not name.endswith("proj.weight"):
                continue
            w0, w1 = a.get(name).float(), b.get(name).float()
            move += float((w1 - w0).pow(2).sum())
            n += w0.numel()
            for view, of in views.items():
                d = of(w1) - of(w0)
                error[view] += float((d - (w1 - w0)).pow(2).sum())
                changed[view] += int((d != 0).sum())
    out = {"logit_scale": scale}
    for view in views:
        out[f"{view}_changed"] = changed[view] / max(n, 1)
        out[f"{view}_error"] = (error[view] / move) ** 0.5 if move else 0.0
    return out


def study_verdicts(
    runs: dict[tuple[str, int], dict[str, Any]], pairs: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Each pair's gain over the start; then each pair against the last one (the reference): its gain
    minus the reference's (does it learn as much?), and its accuracy after RL minus the reference's
    (where it ends: the start's own gap, the FP8 export's quantization, included). Points, 95% t,
    paired by RL seed."""
    start = {p: {seed: 100 * r["val"][0][1] for (q, seed), r in runs.items() if q == p} for p in pairs}
    end = {p: {seed: 100 * r["val"][-1][1] for (q, seed), r in runs.items() if q == p} for p in pairs}
    gain = {p: paired_gaps(end[p], start[p], False) for p in pairs}
    rows = []

    def row(what: str, gaps: dict[int, float]) -> None:
        v = paired_verdict(list(gaps.values()), MARGIN, True)
        rows.append({"what": what, **asdict(v), "n": v.n})

    for p in pairs:
        row(f"{p}: RL - SFT start", gain[p])
    ref = pairs[-1]
    for p in pairs[:-1]:
        row(f"{p} - {ref}, gain over the start", paired_gaps(gain[p], gain[ref], False))
        row(f"{p} - {ref} after RL", paired_gaps(end[p], end[ref], False))
    return rows


def accuracy_name(study: dict[str, Any]) -> str:
    """What the study's held-out accuracy is: ``greedy``, or ``avg@k (T t)``."""
    k = study.get("eval_samples")
    return "greedy" if k is None else f"avg@{k} (T {study['temperature']:g})"


def _line(row: dict[str, Any]) -> str:
    return f"  {row['what']}: {row['mean']:+.1f} [{row['low']:+.1f}, {row['high']:+.1f}] n={row['n']}: {row['label']}"


def report_text(record: dict[str, Any]) -> str:
    study, lines = record["study"], []
    for p in study["pairs"]:
        runs = [r for r in record["runs"] if r["pair"] == p]
        starts = " ".join(f"{100 * r['val'][0][1]:.1f}" for r in runs)
        ends = " ".join(f"{100 * r['val'][-1][1]:.1f}" for r in runs)
        dlogp = sum(sum(r["abs_dlogp_mean"]) / len(r["abs_dlogp_mean"]) for r in runs) / len(runs)
        lines.append(
            f"  {p}: held-out {accuracy_name(study)} % by seed, start {starts} -> after {study['steps']} steps {ends}; mean |dlogp| {dlogp:.2e}"
        )
        views = [r["weight_views"] for r in runs]
        lines.append(
            "    projections moved by RL, seen in FP8 (128x128 E4M3): "
            + _view_text(views, "fp8")
            + "; in bf16: "
            + _view_text(views, "bf16")
            + f"; final norm (logit scale) x{sum(v['logit_scale'] for v in views) / len(views):.4f}"
        )
        for r in runs:
            for trip in r["guard"]:
                lines.append(f"    seed {r['seed']}: {trip['why']}")
    head = (
        f"RL after the demo's SFT ({record['start']}), {study['split']} split, {study['steps']} steps at lr {study['lr']:g}, "
        f"RL seeds {','.join(map(str, study['seeds']))} ({record['seconds']:.0f} s):"
    )
    verdict = f"verdict (95% t-interval over RL seeds, held-out accuracy points, margin +-{MARGIN:g}):"
    return "\n".join([head, *lines, verdict, *map(_line, record["verdicts"]), "figure: rl/rl.png"])


def _view_text(views: list[dict[str, float]], view: str) -> str:
    changed = sum(v[f"{view}_changed"] for v in views) / len(views)
    error = sum(v[f"{view}_error"] for v in views) / len(views)
    return f"{100 * changed:.0f}% of values changed, rounding error {error:.2f}x the master weights' move"


def rl_figure(record: dict[str, Any], path: Path) -> Path:
    """Reward, held-out accuracy and mismatch over the steps, per pair (seeds thin, mean thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..bench.fidelity_report import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = dict(
        zip(record["study"]["pairs"], ("tab:red", "tab:blue", "tab:green", "tab:purple"), strict=False)
    )
    panels = (
        (
            "reward",
            f"rollout reward (mean, T {record['study']['temperature']:g})",
            lambda r: (r["steps"], r["reward"]),
        ),
        (
            "val",
            f"held-out {accuracy_name(record['study'])} accuracy ({record['study']['split']} split)",
            lambda r: tuple(zip(*r["val"], strict=True)),
        ),
        ("dlogp", "rollout/trainer mismatch: mean |dlogp|", lambda r: (r["steps"], r["abs_dlogp_mean"])),
    )
    for ax, (key, title, xy) in zip(axes, panels, strict=True):
        for pair, colour in colours.items():
            curves = [xy(r) for r in record["runs"] if r["pair"] == pair]
            for x, y in curves:
                ax.plot(x, y, color=colour, alpha=0.25, lw=0.8)
            x = curves[0][0]
            mean = [sum(c[1][i] for c in curves) / len(curves) for i in range(len(x))]
            ax.plot(x, mean, color=colour, lw=2, label=pair)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if key == "dlogp" and any(v > 0 for r in record["runs"] for v in r["abs_dlogp_mean"]):
            ax.set_yscale("log")
        ax.legend()
    fig.suptitle("\n".join(_line(v).strip() for v in record["verdicts"]), fontsize=8)
    save_figure(fig, path)
    return path
