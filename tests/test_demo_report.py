"""The demo's computed verdict, on planted runs (no training): paired gaps, seed spread, the rule, the
README block, ``results.json`` and the CLI options that re-render from it.

Expected values are worked out by hand from the definitions (gap = FP8 minus the baseline at the same
seed; losses in % of the baseline, accuracy in points; spread = (max - min) / mean for losses, max - min
for accuracy; within noise iff |mean gap| <= spread), not by calling the code under test.
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


def _run(recipe: str, seed: int, cpt: float, sft: float, acc: float, seconds: float = 10.0,
         train_seconds: float = 5.0) -> RecipeResult:  # fmt: skip
    return RecipeResult(recipe=recipe, seed=seed, cpt_loss=cpt + 0.1, cpt_val_loss=cpt, sft_loss=sft,
                        sft_val_loss=sft, accuracy=acc, unparseable=0, tokens_per_s=1000.0, seconds=seconds,
                        train_seconds=train_seconds, cpt_curve=[(1, 5.0), (2, cpt)],
                        sft_curve=[(1, 1.0), (2, sft)])  # fmt: skip


BASE = [_run("bf16", 0, 2.0, 0.05, 0.70, 10.0, 5.0), _run("bf16", 1, 2.2, 0.06, 0.76, 12.0, 7.0)]
# blockwise: CPT gaps +1% and 0%, SFT gaps +10% and 0%, accuracy -4 and -2 points: all within the spread
CLOSE = [
    _run("blockwise", 0, 2.02, 0.055, 0.66, 30.0, 9.0),
    _run("blockwise", 1, 2.2, 0.06, 0.74, 36.0, 15.0),
]
# tensorwise: accuracy -10 and -10 points, beyond the baseline's 6-point spread
FAR = [_run("tensorwise", 0, 2.0, 0.05, 0.60), _run("tensorwise", 1, 2.2, 0.06, 0.66)]
RECIPES = ["bf16", "blockwise", "tensorwise"]


def test_gaps_spreads_and_verdict_by_hand():
    base, close, far = summarize(BASE + CLOSE + FAR, RECIPES)
    assert base.gaps == () and base.within_noise is None
    cpt, sft, acc = close.gaps
    assert cpt.seeds == (0, 1) and cpt.gaps == pytest.approx((1.0, 0.0))
    assert cpt.mean == pytest.approx(0.5) and cpt.sd == pytest.approx(math.sqrt(0.5))  # sample sd of (1, 0)
    assert cpt.spread == pytest.approx(100 * 0.2 / 2.1)  # 9.52%
    assert sft.gaps == pytest.approx((10.0, 0.0)) and sft.spread == pytest.approx(100 * 0.01 / 0.055)
    assert acc.gaps == pytest.approx((-4.0, -2.0)) and acc.mean == pytest.approx(-3.0)
    assert acc.sd == pytest.approx(math.sqrt(2)) and acc.spread == pytest.approx(6.0)
    assert all(g.within_noise for g in close.gaps) and close.within_noise is True
    assert close.means["cpt_val_loss"] == pytest.approx(2.11) and close.means["accuracy"] == pytest.approx(
        0.70
    )
    assert close.seconds == pytest.approx(33.0) and close.time_ratio == pytest.approx(3.0)  # 33 s / 11 s
    assert close.train_ratio == pytest.approx(2.0)  # steps alone: 12 s / 6 s
    assert [g.within_noise for g in far.gaps] == [True, True, False] and far.within_noise is False
    assert far.gaps[2].mean == pytest.approx(-10.0)


def test_the_verdict_flips_where_the_gap_crosses_the_spread():
    """Accuracy gap -6 points against a 6-point spread is within (<=); -6.2 is not."""
    at_edge = [_run("blockwise", 0, 2.0, 0.05, 0.64), _run("blockwise", 1, 2.2, 0.06, 0.70)]
    beyond = [_run("blockwise", 0, 2.0, 0.05, 0.638), _run("blockwise", 1, 2.2, 0.06, 0.698)]
    assert summarize(BASE + at_edge, ["bf16", "blockwise"])[1].within_noise is True
    assert summarize(BASE + beyond, ["bf16", "blockwise"])[1].within_noise is False


def test_verdict_sentences_state_gap_sd_and_spread():
    _, close, far = summarize(BASE + CLOSE + FAR, RECIPES)
    assert verdict_sentence(close) == (
        "FP8 blockwise is within noise of the baseline: CPT held-out loss +0.50 +- 0.71% (baseline seed spread "
        "9.52%), SFT val loss +5.00 +- 7.07% (baseline seed spread 18.18%), accuracy -3.0 +- 1.4 points "
        "(baseline seeds 70-76%)."
    )
    sentence = verdict_sentence(far)
    assert sentence.startswith("FP8 tensorwise is NOT within noise of the baseline (accuracy beyond")
    assert "accuracy -10.0 +- 0.0 points (baseline seeds 70-76%)" in sentence


def test_one_seed_is_not_judged():
    _, fp8 = summarize(BASE[:1] + CLOSE[:1], ["bf16", "blockwise"])
    assert fp8.within_noise is None and fp8.gaps[0].sd is None
    assert "cannot be judged" in verdict_sentence(fp8) and "+1.00% (1 seed)" in verdict_sentence(fp8)


def test_a_recipe_without_runs_is_an_error():
    with pytest.raises(ValueError, match=r"no runs of recipe\(s\) \['rowwise'\]"):
        summarize(BASE, ["bf16", "rowwise"])


def _record(runs: list[RecipeResult] | None = None) -> DemoRecord:
    return DemoRecord(settings=QUICK, recipes=RECIPES, runs=runs or BASE + CLOSE + FAR, chance_accuracy=0.08,
                      seconds=600.0, jobs=2, machine="2 CPUs, test", date="2026-11-30")  # fmt: skip


def test_readme_table_rows_and_verdicts():
    text = readme_table(_record())
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 4  # header + 3 recipes
    assert "seed spread 9.52%" in rows[1] and "seeds 70-76%" in rows[1]  # the baseline's own noise
    assert "| 2.1100 | +0.50 +- 0.71% |" in rows[2] and "| 3.00x | 2.00x |" in rows[2]
    assert "guessing the most common answer scores 8%" in text.lower()
    assert text.count("- On the arithmetic task: FP8 ") == 2 and "FP8 tensorwise is NOT within noise" in text
    assert "Real-text verdict: not run" in text  # no real-text part in this record


def test_real_text_verdict_is_computed_from_its_runs():
    """The real-text part: paired gaps against the baseline's seed spread, one sentence per recipe."""
    from infir2.tools.bench.fidelity_report import RunResult as TextRun
    from infir2.tools.bench.fidelity_report import summarize as summarize_text
    from infir2.tools.demo.text import text_section

    def run(recipe, seed, loss):
        return TextRun(width=256, recipe=recipe, seed=seed, val_loss=loss, train_loss=loss, tail_drop=1.0,
                       steps=100, seconds=1.0)  # fmt: skip

    runs = [run("bf16", 0, 5.00), run("bf16", 1, 5.05), run("blockwise", 0, 5.01), run("blockwise", 1, 5.06),
            run("tensorwise", 0, 5.20), run("tensorwise", 1, 5.25)]  # fmt: skip
    settings = {"val_every": 20, "vocab_size": 4096, "widths": [256], "layers": 4, "steps": 100, "batch": 8,
                "seq_len": 128, "lr": 2e-3}  # fmt: skip
    text = {"settings": settings, "data": {"characters": 1000}, "runs": [vars(r) for r in runs],
            "summary": summarize_text(runs)}  # fmt: skip
    lines = "\n".join(text_section(text, {"blockwise": "FP8 blockwise", "tensorwise": "FP8 tensorwise"}))
    spread = 100 * 0.05 / 5.025  # the baseline's (max - min) / mean, in %
    assert f"FP8 blockwise is within noise of the baseline on real text: held-out loss +0.20% +- 0.00% " \
           f"(baseline seed spread {spread:.2f}%)" in lines  # fmt: skip
    assert "FP8 tensorwise is NOT within noise" in lines  # +4% against a 1% spread
    assert "| 256 | blockwise | 5.0100 / 5.0600 |" in lines


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{README_START}\nold table\n{README_END}\nafter\n")
    update_readme(readme, _record())
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{README_END}\nafter\n")
    assert "old table" not in text and "FP8 blockwise is within noise" in text
    update_readme(readme, _record())
    assert readme.read_text() == text  # idempotent


@pytest.mark.parametrize("content", [f"{README_START}\nno end\n", "no markers at all\n",
                                     f"{README_START}\n{README_START}\n{README_END}\n"])  # fmt: skip
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
    assert "FP8 tensorwise is NOT within noise" in (out / "report.md").read_text()
    assert (out / "readme_table.md").read_text() in readme.read_text()
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert main(["demo", "--report-only", "--out", str(tmp_path / "empty")]) == 2
    assert "results.json: not found" in capsys.readouterr().err


def test_parse_seeds():
    assert parse_seeds("0,1") == (0, 1) and parse_seeds(" 3 , 1 ,") == (3, 1)


@pytest.mark.parametrize(("seeds", "message"), [("", "expected comma-separated integers"),
                                                ("0,x", "'x' is not a non-negative integer"),
                                                ("0,-1", "'-1' is not a non-negative integer"),
                                                ("1,1", "seed(s) [1] given twice")])  # fmt: skip
def test_bad_seeds_are_clear_errors(tmp_path, capsys, seeds, message):
    assert main(["demo", "--quick", "--out", str(tmp_path / "d"), "--seeds", seeds]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before anything is written
