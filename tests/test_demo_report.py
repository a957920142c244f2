"""The demo's computed verdict, on planted runs (no training): paired gaps, their t-intervals against
the margins, the README block, ``results.json`` and the CLI options that re-render from it.

Expected values are worked out by hand from the definitions (gap = FP8 minus the baseline at the same
seed; losses in % of the baseline, accuracy in points; interval = mean +- t(n-1) sd / sqrt(n) with the
table value t(2) = 4.303; margins +-2% CPT, +-10% SFT, +-3 points accuracy), not by calling the code
under test.
"""

from __future__ import annotations

import json
import math

import pytest

from infir2.cli import main
from infir2.tools.demo import QUICK, DemoRecord, RecipeResult
from infir2.tools.demo.command import parse_seeds
from infir2.tools.demo.report import README_END, README_START, readme_table, update_readme
from infir2.tools.demo.summary import summarize, verdict_sentence
from test_bench_fidelity import fidelity_run


def _run(
    recipe: str,
    seed: int,
    cpt: float,
    sft: float,
    acc: float,
    seconds: float = 10.0,
    train_seconds: float = 5.0,
) -> RecipeResult:
    return RecipeResult(
        recipe=recipe,
        seed=seed,
        cpt_loss=cpt + 0.1,
        cpt_val_loss=cpt,
        sft_loss=sft,
        sft_val_loss=sft,
        accuracy=acc,
        unparseable=0,
        tokens_per_s=1000.0,
        seconds=seconds,
        train_seconds=train_seconds,
        cpt_curve=[(1, 5.0), (2, cpt)],
        sft_curve=[(1, 1.0), (2, sft)],
    )


BASE = [
    _run("bf16", 0, 2.0, 0.05, 0.90, 10.0, 5.0),
    _run("bf16", 1, 2.2, 0.06, 0.96, 12.0, 7.0),
    _run("bf16", 2, 2.1, 0.05, 0.93, 11.0, 6.0),
]
# blockwise: CPT gaps +0.5, 0, +0.5 %; SFT +1, 0, +1 %; accuracy -1, 0, 0 points: every interval inside its margin
CLOSE = [
    _run("blockwise", 0, 2.01, 0.0505, 0.89, 30.0, 9.0),
    _run("blockwise", 1, 2.2, 0.06, 0.96, 36.0, 15.0),
    _run("blockwise", 2, 2.1105, 0.0505, 0.93, 33.0, 12.0),
]
# tensorwise: losses equal to the baseline's, accuracy -10 points at every seed: resolved, worse
FAR = [
    _run("tensorwise", 0, 2.0, 0.05, 0.80),
    _run("tensorwise", 1, 2.2, 0.06, 0.86),
    _run("tensorwise", 2, 2.1, 0.05, 0.83),
]
RECIPES = ["bf16", "blockwise", "tensorwise"]
T2 = 4.303  # two-sided 95% t quantile, 2 degrees of freedom (statistics table)


def test_gaps_intervals_and_verdict_by_hand():
    base, close, far = summarize(BASE + CLOSE + FAR, RECIPES)
    assert base.gaps == () and base.verdict is None
    cpt, sft, acc = close.gaps
    assert cpt.seeds == (0, 1, 2) and cpt.gaps == pytest.approx((0.5, 0.0, 0.5))
    assert cpt.mean == pytest.approx(1 / 3) and cpt.sd == pytest.approx(math.sqrt(1 / 12))
    half = T2 * math.sqrt(1 / 12) / math.sqrt(3)
    assert (cpt.verdict.low, cpt.verdict.high) == pytest.approx((1 / 3 - half, 1 / 3 + half), abs=1e-3)
    assert cpt.spread == pytest.approx(100 * 0.2 / 2.1)  # the baseline's own seed spread, 9.52%
    assert sft.gaps == pytest.approx((1.0, 0.0, 1.0)) and acc.gaps == pytest.approx((-1.0, 0.0, 0.0))
    assert [g.verdict.label for g in close.gaps] == ["equivalent"] * 3 and close.verdict == "equivalent"
    assert close.means["cpt_val_loss"] == pytest.approx(6.3205 / 3)
    assert close.seconds == pytest.approx(33.0) and close.time_ratio == pytest.approx(3.0)  # 33 s / 11 s
    assert close.train_ratio == pytest.approx(2.0)  # steps alone: 12 s / 6 s
    assert [g.verdict.label for g in far.gaps] == ["equivalent", "equivalent", "worse"]
    assert far.verdict == "worse" and far.gaps[2].mean == pytest.approx(-10.0)


def test_the_verdict_moves_with_the_interval_not_the_mean():
    """The same mean accuracy gap (-1 point) is equivalent when the seeds agree and inconclusive when
    they scatter; a clear gap beyond the margin is worse; two seeds rarely resolve anything (t(1) = 12.7)."""
    tight = [
        _run("blockwise", k, b.cpt_val_loss, b.sft_val_loss, b.accuracy - 0.01) for k, b in enumerate(BASE)
    ]
    loose = [
        _run("blockwise", k, b.cpt_val_loss, b.sft_val_loss, b.accuracy + d)
        for k, (b, d) in enumerate(zip(BASE, (-0.06, 0.05, -0.02), strict=True))
    ]
    assert summarize(BASE + tight, ["bf16", "blockwise"])[1].verdict == "equivalent"
    assert summarize(BASE + loose, ["bf16", "blockwise"])[1].verdict == "inconclusive: more seeds needed"
    two = summarize(BASE[:2] + CLOSE[:2], ["bf16", "blockwise"])[1]
    assert two.verdict == "inconclusive: more seeds needed"  # CPT gaps +0.5, 0: [-3.9, +4.4] exceeds +-2%


def test_verdict_sentences_state_gap_interval_margin_and_null_control():
    summaries = summarize(BASE + CLOSE + FAR, RECIPES)
    _, close, far = summaries
    sentence = verdict_sentence(close, null=far)  # far stands in for the null control here
    assert sentence.startswith("FP8 blockwise: equivalent to the baseline (mean paired gap over 3 seed(s)")
    assert (
        "accuracy -0.3 points [-1.8, +1.1] against +-3 points: equivalent (null control -10.0 points "
        "[-10.0, -10.0], baseline seeds 90-96%)" in sentence
    )
    # the losses of the reasoning task are reported after the judged metric, not in the recipe's verdict
    judged, reported = sentence.split(" Reported, not judged at 3 seed(s): ")
    assert "CPT held-out loss" not in judged
    assert "CPT held-out loss +0.33% [-0.38, +1.05] against +-2%: equivalent" in reported
    assert verdict_sentence(far).startswith("FP8 tensorwise: WORSE than the baseline")


def test_the_recipe_verdict_reads_the_headline_metrics_only():
    """CPT held-out loss +10% at every seed (resolved worse) with the baseline's accuracy: the recipe is
    equivalent by its headline metric, and the sentence still reports the CPT loss as worse."""
    cpt_worse = [_run("blockwise", b.seed, 1.1 * b.cpt_val_loss, b.sft_val_loss, b.accuracy) for b in BASE]
    _, fp8 = summarize(BASE + cpt_worse, ["bf16", "blockwise"])
    assert [g.verdict.label for g in fp8.gaps] == ["worse", "equivalent", "equivalent"]
    assert fp8.verdict == "equivalent"
    assert (
        "Reported, not judged at 3 seed(s): CPT held-out loss +10.00% [+10.00, +10.00] against +-2%: worse"
        in (verdict_sentence(fp8))
    )


def test_one_seed_is_not_judged():
    _, fp8 = summarize(BASE[:1] + CLOSE[:1], ["bf16", "blockwise"])
    assert fp8.verdict == "inconclusive: more seeds needed" and fp8.gaps[0].sd is None
    assert "+0.50% (1 seed)" in verdict_sentence(fp8)


def test_a_recipe_without_runs_is_an_error():
    with pytest.raises(ValueError, match=r"no runs of recipe\(s\) \['rowwise'\]"):
        summarize(BASE, ["bf16", "rowwise"])


def _record(runs: list[RecipeResult] | None = None) -> DemoRecord:
    return DemoRecord(
        settings=QUICK,
        recipes=RECIPES,
        runs=runs or BASE + CLOSE + FAR,
        chance_accuracy=0.08,
        seconds=600.0,
        jobs=2,
        machine="2 CPUs, test",
        date="2026-11-30",
    )


def test_readme_table_rows_and_verdicts():
    text = readme_table(_record())
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 4  # header + 3 recipes
    assert "seed spread 9.52%" in rows[1] and "seeds 90-96%" in rows[1]  # the baseline's own noise
    assert "| 2.1068 | +0.33% [-0.38, +1.05] |" in rows[2] and "| 3.00x | 2.00x |" in rows[2]
    assert "guessing the most common answer scores 8%" in text.lower()
    assert (
        text.count("- On the reasoning task: FP8 ") == 2 and "FP8 tensorwise: WORSE than the baseline" in text
    )
    assert "Real-text verdict: not run" in text  # no real-text part in this record


def test_real_text_verdict_is_computed_from_its_runs():
    """The real-text part: paired gaps with their intervals against +-1%, one sentence per recipe."""
    from infir2.tools.bench.fidelity_report import summarize as summarize_text
    from infir2.tools.demo.text import text_section

    def run(recipe, seed, loss):
        return fidelity_run(256, recipe, seed, loss, tail_drop=1.0, steps=100)

    runs = [
        run("bf16", 0, 5.00),
        run("bf16", 1, 5.05),
        run("bf16", 2, 5.10),
        run("blockwise", 0, 5.01),
        run("blockwise", 1, 5.0601),
        run("blockwise", 2, 5.1102),
        run("tensorwise", 0, 5.20),
        run("tensorwise", 1, 5.252),
        run("tensorwise", 2, 5.304),
    ]
    settings = {
        "val_every": 20,
        "vocab_size": 4096,
        "widths": [256],
        "layers": 4,
        "steps": 100,
        "batch": 8,
        "seq_len": 128,
        "lr": 2e-3,
        "eval_batches": 51,
        "eval_every": 20,
    }
    text = {
        "settings": settings,
        "data": {"characters": 1000},
        "runs": [vars(r) for r in runs],
        "summary": summarize_text(runs),
    }
    lines = "\n".join(text_section(text, {"blockwise": "FP8 blockwise", "tensorwise": "FP8 tensorwise"}))
    spread = 100 * 0.10 / 5.05  # the baseline's (max - min) / mean, in %
    # blockwise gaps +0.2% at each seed (to rounding): a tight interval inside +-1%
    assert (
        "FP8 blockwise on real text: held-out loss +0.20% [+0.20, +0.20] against +-1%: **equivalent** "
        f"(baseline seed spread {spread:.2f}%)" in lines
    )
    assert "FP8 tensorwise on real text: held-out loss +4.00% [+4.00, +4.00] against +-1%: **worse**" in lines
    assert "| 256 | blockwise | 5.0100 / 5.0601 / 5.1102 |" in lines
    assert (
        "fp32 on 51 batches of 8 held-out windows of 128 tokens every 20 steps" in lines
        and "its last evaluation" in lines
    )


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{README_START}\nold table\n{README_END}\nafter\n")
    update_readme(readme, _record())
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{README_END}\nafter\n")
    assert "old table" not in text and "FP8 blockwise: equivalent to the baseline" in text
    update_readme(readme, _record())
    assert readme.read_text() == text  # idempotent


@pytest.mark.parametrize(
    "content",
    [f"{README_START}\nno end\n", "no markers at all\n", f"{README_START}\n{README_START}\n{README_END}\n"],
)
def test_update_readme_names_the_file_and_the_marker(tmp_path, content):
    readme = tmp_path / "README.md"
    readme.write_text(content)
    with pytest.raises(ValueError) as e:
        update_readme(readme, _record())
    assert str(readme) in str(e.value) and "demo-table:" in str(e.value)
    assert readme.read_text() == content  # untouched


def test_update_readme_refuses_markers_in_the_wrong_order(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"{README_END}\n{README_START}\n")
    with pytest.raises(ValueError, match="comes before"):
        update_readme(readme, _record())


def test_results_json_round_trips(tmp_path):
    _record().save(tmp_path / "results.json")
    loaded = DemoRecord.load(tmp_path / "results.json")
    assert loaded == _record()


def test_results_json_errors_name_the_file(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("[]")  # an older demo's list of runs
    with pytest.raises(ValueError, match=r"results\.json: expected an object"):
        DemoRecord.load(path)
    raw = json.loads(
        json.dumps({"settings": {}, "runs": [], "recipes": [], "chance_accuracy": 0, "seconds": 0})
    )
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"results\.json: missing key 'jobs'"):
        DemoRecord.load(path)
    with pytest.raises(ValueError, match="not found"):
        DemoRecord.load(tmp_path / "nowhere.json")


def test_report_only_and_update_readme_from_the_cli(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    _record().save(out / "results.json")
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{README_START}\n{README_END}\n")
    assert main(["demo", "--report-only", "--update-readme", str(readme), "--out", str(out)]) == 0
    assert "FP8 tensorwise: WORSE than the baseline" in (out / "report.md").read_text()
    assert (out / "readme_table.md").read_text() in readme.read_text()
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert main(["demo", "--report-only", "--out", str(tmp_path / "empty")]) == 2
    assert "results.json: not found" in capsys.readouterr().err


def test_parse_seeds():
    assert parse_seeds("0,1") == (0, 1) and parse_seeds(" 3 , 1 ,") == (3, 1)


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        ("", "expected comma-separated integers"),
        ("0,x", "'x' is not a non-negative integer"),
        ("0,-1", "'-1' is not a non-negative integer"),
        ("1,1", "seed(s) [1] given twice"),
    ],
)
def test_bad_seeds_are_clear_errors(tmp_path, capsys, seeds, message):
    assert main(["demo", "--quick", "--out", str(tmp_path / "d"), "--seeds", seeds]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before anything is written
