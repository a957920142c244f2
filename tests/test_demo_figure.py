"""The demo's figures and headline, drawn from a small planted ``results.json`` (no training).

The verdict figure must show what the report says: per headline metric a gap panel whose bar sits at
the mean paired gap, whose band is the margin; the real-text curves; and the PNG must not be blank.
Expected gaps are worked out by hand from the planted losses (gap = 100 * (fp8 - base) / base).
"""

from __future__ import annotations

import dataclasses

import pytest

from infir2.cli import main
from infir2.tools.demo import DemoRecord
from infir2.tools.demo.figure import loss_curves_figure, verdict_bars, verdict_figure
from infir2.tools.demo.report import headline
from infir2.tools.paired import seeds_needed, t_quantile
from test_bench_fidelity import fidelity_run
from test_demo_report import BASE, CLOSE, _record, _run


def _text_part(losses: dict[str, tuple[float, ...]]) -> dict:
    from infir2.tools.bench.fidelity_report import summarize as summarize_text

    runs = [
        dataclasses.replace(
            fidelity_run(256, recipe, seed, loss, steps=80),
            val_curve=((40, loss + 0.5), (80, loss)),
        )
        for recipe, values in losses.items()
        for seed, loss in enumerate(values)
    ]
    from infir2.tools.bench.fidelity import FidelitySettings

    return {
        "settings": dataclasses.asdict(FidelitySettings(widths=(256,), steps=80, eval_every=40)),
        "data": {"characters": 1000},
        "runs": [dataclasses.asdict(r) for r in runs],
        "summary": summarize_text(runs),
    }


# blockwise +0.2% at each seed; the null control 0, +0.1, -0.1 %
TEXT = _text_part(
    {"bf16": (5.0, 5.0, 5.0), "blockwise": (5.01, 5.01, 5.01), "fp8_exact": (5.0, 5.005, 4.995)}
)
NULL = [
    _run("fp8_exact", 0, 2.0, 0.05, 0.90),
    _run("fp8_exact", 1, 2.2, 0.06, 0.97),
    _run("fp8_exact", 2, 2.1, 0.05, 0.93),
]  # accuracy 0, +1, 0 points


def _with_text() -> DemoRecord:
    return dataclasses.replace(
        _record(BASE + CLOSE + NULL), recipes=["bf16", "blockwise", "fp8_exact"], text=TEXT
    )


def test_the_verdict_panels_hold_the_paired_gaps():
    panels = verdict_bars(_with_text())
    assert list(panels) == ["real text: held-out loss gap", "reasoning task: accuracy gap"]
    margin, unit, (block, null) = panels["real text: held-out loss gap"]
    assert (margin, unit) == (1.0, "%") and block.recipe == "blockwise" and null.recipe == "fp8_exact"
    assert block.gaps == pytest.approx((0.2, 0.2, 0.2)) and block.verdict == "equivalent"
    assert null.mean == pytest.approx(0.0, abs=1e-9)
    half = t_quantile(2) * 0.1 / 3**0.5  # sd of (0, +0.1, -0.1) is 0.1
    assert (null.low, null.high) == pytest.approx((-half, half))
    margin, unit, (block, null) = panels["reasoning task: accuracy gap"]
    assert (margin, unit) == (3.0, "points")
    assert block.gaps == pytest.approx((-1.0, 0.0, 0.0)) and null.gaps == pytest.approx((0.0, 1.0, 0.0))


def test_the_verdict_figure_draws_bars_bands_and_curves():
    fig = verdict_figure(_with_text())
    text_ax, acc_ax, curves = fig.axes
    assert "real text" in text_ax.get_title() and "accuracy" in acc_ax.get_title()
    # the shaded margin band spans -1..+1 % (a Rectangle / Polygon patch), the bars' means are drawn
    band = text_ax.patches[0].get_path().get_extents().transformed(text_ax.patches[0].get_patch_transform())
    assert (band.y0, band.y1) == pytest.approx((-1.0, 1.0))
    means = [line.get_ydata()[0] for line in text_ax.lines if line.get_gid() == "mean"]
    assert means == pytest.approx([0.2, 0.0], abs=1e-9)
    labels = [t.get_text() for t in acc_ax.get_xticklabels()]
    assert labels[0].startswith("FP8 blockwise\n3 seed(s)\n") and labels[1].startswith("null control")
    assert curves.get_yscale() == "log" and len(curves.lines) == 9  # 3 recipes x 3 seeds
    assert list(curves.lines[0].get_xdata()) == [40, 80]


def test_the_figure_files_are_not_blank(tmp_path):
    import matplotlib.image

    out = tmp_path / "demo"
    out.mkdir()
    _with_text().save(out / "results.json")
    assert main(["demo", "--report-only", "--out", str(out)]) == 0  # redrawn from results.json alone
    for name in ("verdict.png", "loss_curves.png"):
        pixels = matplotlib.image.imread(out / name)[..., :3]
        height, width, _ = pixels.shape
        assert width > 2 * height  # panels side by side
        for third in range(3):  # every panel region holds drawing, not only background
            region = pixels[:, third * width // 3 : (third + 1) * width // 3]
            assert (region < 0.9).any(axis=-1).mean() > 0.01
    assert "![the verdict](verdict.png)" in (out / "report.md").read_text()
    assert loss_curves_figure(_with_text()).axes[0].get_yscale() == "log"


def test_headline_reads_real_text_and_accuracy_and_leaves_the_noisy_losses_out():
    lines = "\n".join(headline(_with_text()))
    # blockwise: real text +0.2% [+0.2, +0.2], accuracy -0.33 [-1.8, +1.1]: both equivalent
    assert (
        "- FP8 blockwise: **equivalent** -- real-text held-out loss +0.20% [+0.20, +0.20] against +-1%"
        in lines
    )
    assert "accuracy -0.3 points [-1.8, +1.1] against +-3 points: equivalent" in lines
    assert "CPT held-out loss" not in lines.split("Not in the headline")[0]
    assert "Not in the headline" in lines and "SFT val loss" in lines.split("Not in the headline")[1]


def test_an_unresolved_metric_says_how_many_seeds_it_would_need():
    """Accuracy gaps -6, +5, -2 points (sd 5.57): inconclusive at 3 seeds; the note gives the n at which
    |mean| + t(n-1) sd / sqrt(n) first fits inside +-3 points, checked here by the definition."""
    loose = [
        _run("blockwise", k, b.cpt_val_loss, b.sft_val_loss, b.accuracy + d)
        for k, (b, d) in enumerate(zip(BASE, (-0.06, 0.05, -0.02), strict=True))
    ]
    record = dataclasses.replace(_record(BASE + loose), recipes=["bf16", "blockwise"], text=None)
    lines = "\n".join(headline(record))
    mean, sd = -1.0, (((5) ** 2 + 6**2 + 1) / 2) ** 0.5
    n = seeds_needed(mean, sd, 3.0)
    assert n is not None and n > 3
    assert (
        abs(mean) + t_quantile(n - 1) * sd / n**0.5
        <= 3.0
        < abs(mean) + t_quantile(n - 2) * sd / (n - 1) ** 0.5
    )
    assert (
        f"inconclusive: more seeds needed (~{n} seeds would resolve +-3 points at the measured sd)" in lines
    )
    assert "real-text held-out loss: not run for this recipe" in lines


def test_seeds_needed_by_the_definition():
    assert seeds_needed(0.0, 0.0, 1.0) == 2  # no scatter: two seeds suffice
    assert seeds_needed(1.5, 0.1, 1.0) is None  # the mean lies outside the margin
    n = seeds_needed(0.2, 0.5, 1.0)  # t(n-1) * 0.5 / sqrt(n) <= 0.8
    assert n == next(k for k in range(2, 100) if t_quantile(k - 1) * 0.5 / k**0.5 <= 0.8)
    with pytest.raises(ValueError, match="margin > 0"):
        seeds_needed(0.0, 1.0, 0.0)


def test_the_real_text_read_out_averages_the_last_evaluations():
    from infir2.tools.demo.text import read_out

    run = dataclasses.replace(fidelity_run(256, "bf16", 0, 3.0), val_curve=((16, 5.0), (32, 4.0), (48, 3.0)))
    assert read_out(run, 1) is run and read_out(run, 2).val_loss == pytest.approx(3.5)
    assert read_out(run, 3).val_loss == pytest.approx(4.0) and read_out(run, 3).val_curve == run.val_curve
    with pytest.raises(ValueError, match="text_readout_evals 4: the run bf16 s0 has 3 held-out evaluation"):
        read_out(run, 4)
