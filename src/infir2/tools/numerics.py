"""Where does FP8 hurt? Rank a run's layers by their FP8 telemetry and draw them over steps.

Reads the per-layer telemetry that a run recorded with ``fp8.stats_every: N`` in its config (or
``infir2 train run.yaml --set fp8.stats_every=50``): every N steps, for every FP8 projection and each
operand it quantizes (``fprop.x``, ``fprop.w``, ``dgrad.dy``, ``dgrad.w``, ``wgrad.dy``, ``wgrad.x``)::

    underflow    fraction of the operand's non-zero elements that became FP8 zero. A block scale
                 is set by the block's largest element, so an outlier (one massive-activation token
                 under tensorwise scaling) or a block of tiny values whose scale cannot grow any
                 further (pow2 scales stop at 2**127) flushes its neighbours. Healthy: below ~1e-3.
    saturation   fraction at the format's max (448 for E4M3): the pow2 rule rounds the scale down,
                 so a block's largest element may land on it; more than that means overflow.
    amax, log2_scale_inv_min/max  the operand's largest magnitude and the range of log2(scale_inv).

and, on one micro-batch, the SQNR (dB) of each GEMM's result (``fprop.y``, ``dgrad.dx``,
``wgrad.dw``) against the same GEMM in fp32 on the unquantized operands. E4M3 with 1x128 / 128x128
blocks gives about 25-35 dB per GEMM; near 0 dB the result is noise. SQNR is a norm ratio over the
whole tensor: a few broken tokens next to a huge one barely move it, which is why underflow is
ranked too. A defect also spreads: a layer whose output is ~0 makes the gradients of the layers
that feed it ~0, so read the tables together (the origin is usually the row with the weight or
input operand).

Prints, per statistic, the worst (layer, GEMM or operand) rows at their worst step, and writes
``numerics.png`` (into the run folder, or --out): one row per layer, one column per stats step,
the layer's lowest SQNR and its highest underflow.

Example::

    infir2 numerics runs/tiny-cpt --top 10
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..nn.telemetry import SQNR_STAT, parse_key

__all__ = ["Telemetry", "add_arguments", "load_telemetry", "plot_heatmap", "report", "run", "worst"]


@dataclass
class Telemetry:
    """A run's telemetry: ``values[(layer, gemm_operand, stat)][step]``, layers in model order."""

    steps: list[int]
    layers: list[str]
    values: dict[tuple[str, str, str], dict[int, float]]


def load_telemetry(run_dir: Path) -> Telemetry:
    """The ``fp8/...`` keys of ``<run_dir>/metrics.jsonl`` (an error naming the file when there are none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run folder of `infir2 train`?)")
    steps: list[int] = []
    layers: dict[str, None] = {}
    values: dict[tuple[str, str, str], dict[int, float]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
        found = False
        for key, value in record.items():
            parsed = parse_key(key)
            if parsed is None or not isinstance(value, (int, float)):
                continue
            found = True
            layers.setdefault(parsed[0])
            values.setdefault(parsed, {})[int(record["step"])] = float(value)
        if found:
            steps.append(int(record["step"]))
    if not steps:
        raise ValueError(
            f"{path}: no FP8 telemetry; train with `fp8.stats_every: N` (e.g. --set fp8.stats_every=50)"
        )
    return Telemetry(steps, list(layers), values)


def worst(tel: Telemetry, stat: str, lowest: bool, top: int) -> list[tuple[str, str, float, int]]:
    """The ``top`` worst ``(layer, gemm_operand, value, step)`` for ``stat``: each row at its worst step,
    the lowest values first when ``lowest`` (SQNR), else the highest; NaN never ranks."""
    rows = []
    for (layer, what, s), by_step in tel.values.items():
        finite = [(v, step) for step, v in by_step.items() if not math.isnan(v)]
        if s == stat and finite:
            value, step = (min if lowest else max)(finite)
            rows.append((layer, what, value, step))
    rows.sort(key=lambda r: r[2], reverse=not lowest)
    return rows[:top]


def report(tel: Telemetry, top: int = 5) -> str:
    """The worst layers by lowest SQNR, highest underflow and highest saturation, as text."""
    lines = [
        f"FP8 telemetry: {len(tel.layers)} layers, {len(tel.steps)} stats steps "
        f"({tel.steps[0]}..{tel.steps[-1]})"
    ]
    width = max(len(layer) for layer in tel.layers)
    tables = (
        (SQNR_STAT, True, "lowest SQNR (dB; ~25-35 is healthy E4M3, ~0 is noise)", "{:8.2f}"),
        ("underflow", False, "highest underflow (fraction of non-zero elements flushed to 0)", "{:8.2e}"),
        ("saturation", False, "highest saturation (fraction at the format's max)", "{:8.2e}"),
    )
    for stat, lowest, title, fmt in tables:
        lines += ["", title, f"  {'layer':<{width}}  {'gemm.op':<9} {'value':>8}  step"]
        for layer, what, value, step in worst(tel, stat, lowest, top):
            lines.append(f"  {layer:<{width}}  {what:<9} {fmt.format(value)}  {step}")
    return "\n".join(lines)


def _layer_grid(tel: Telemetry, stat: str, pick: Callable[[list[float]], float]) -> list[list[float]]:
    """``[layer][step]``: over the layer's GEMMs / operands, the ``pick`` of ``stat`` (NaN when absent)."""
    grid = []
    for layer in tel.layers:
        row = []
        for step in tel.steps:
            got = [
                v[step] for (lay, _, s), v in tel.values.items() if lay == layer and s == stat and step in v
            ]
            got = [g for g in got if not math.isnan(g)]
            row.append(pick(got) if got else math.nan)
        grid.append(row)
    return grid


def plot_heatmap(tel: Telemetry, path: Path) -> Path:
    """``path`` (PNG): per layer x stats step, the lowest SQNR and the highest underflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("lowest SQNR per layer (dB)", _layer_grid(tel, SQNR_STAT, min), "viridis"),
        ("highest underflow per layer", _layer_grid(tel, "underflow", max), "magma_r"),
    )
    height = 1.5 + 0.22 * len(tel.layers)
    fig, axes = plt.subplots(1, 2, figsize=(12, height), sharey=True, squeeze=False)
    for ax, (title, grid, cmap) in zip(axes[0], panels, strict=True):
        image = ax.imshow(
            [[min(v, 60.0) for v in row] for row in grid], aspect="auto", cmap=cmap, interpolation="nearest"
        )  # inf SQNR = exact: capped for colour
        ax.set_title(title)
        ax.set_xlabel("step")
        ticks = range(0, len(tel.steps), max(1, len(tel.steps) // 10))
        ax.set_xticks(list(ticks), [str(tel.steps[i]) for i in ticks])
        fig.colorbar(image, ax=ax)
    axes[0][0].set_yticks(range(len(tel.layers)), tel.layers, fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder (holds metrics.jsonl)")
    parser.add_argument("--top", type=int, default=5, help="rows per table (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="folder for numerics.png (default: RUN_DIR)")


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    tel = load_telemetry(args.run_dir)
    print(report(tel, args.top))
    png = plot_heatmap(tel, (args.out or args.run_dir) / "numerics.png")
    print(f"\nheatmap: {png}")
    return 0
