"""`infir2 demo --quick` end to end: data, tokenizer, CPT + SFT per recipe and seed, evaluation, report and plot."""

from __future__ import annotations

import json
import math

import pytest

from infir2.cli import main


@pytest.mark.slow
def test_quick_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--recipes", "bf16,blockwise,tensorwise"]) == 0
    report = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [(r["recipe"], r["seed"]) for r in runs] == [
        (recipe, seed) for recipe in ("bf16", "blockwise", "tensorwise") for seed in (0, 1)
    ]  # every recipe at both of QUICK's seeds
    for r in runs:
        assert math.isfinite(r["cpt_loss"]) and math.isfinite(r["sft_loss"])
        assert math.isfinite(r["cpt_val_loss"]) and math.isfinite(r["sft_val_loss"])  # final held-out losses
        assert r["cpt_curve"][0][1] > r["cpt_curve"][-1][1]  # CPT loss falls
        assert 0.0 <= r["accuracy"] <= 1.0
        assert (out / "runs" / r["recipe"] / f"s{r['seed']}" / "eval" / "samples.jsonl").is_file()
        assert r["tokens_per_s"] > 0
    base = {r["seed"]: r for r in runs if r["recipe"] == "bf16"}
    assert base[0]["cpt_curve"] != base[1]["cpt_curve"]  # the seed changes the run
    for r in runs:  # FP8 tracks the baseline of the same seed closely even in the reduced run
        assert (
            abs(r["sft_val_loss"] - base[r["seed"]]["sft_val_loss"]) / base[r["seed"]]["sft_val_loss"] < 0.05
        )
    assert (out / "loss_curves.png").stat().st_size > 10_000 and (out / "verdict.png").stat().st_size > 10_000
    for label in ("baseline", "FP8 blockwise", "FP8 tensorwise", "accuracy", "tokens/s", "seed spread"):
        assert label in report
    # a generated verdict per FP8 recipe on the reasoning task, and one on real text
    assert (
        report.count("- On the reasoning task: FP8 ") == 2
        and report.count(" on real text: held-out loss ") == 2
    )
    assert "95% t-interval" in report and "thread(s) per run" in report  # the verdict rule; the machine
    text = results["text"]
    assert sorted((r["recipe"], r["seed"]) for r in text["runs"]) == sorted(
        (recipe, seed) for recipe in ("bf16", "blockwise", "tensorwise") for seed in (0, 1)
    ) and all(math.isfinite(r["val_loss"]) for r in text["runs"])
    for r in text[
        "runs"
    ]:  # the held-out curve: every text_eval_every steps, ending at the final held-out loss
        steps = [step for step, _ in r["val_curve"]]
        assert steps == [2, 4, 5] and r["val_curve"][-1][1] == r["val_loss"]
    assert "**The verdict (seeds 0, 1)" in report
    assert (out / "readme_table.md").read_text() in report
    assert main(["demo", "--report-only", "--out", str(out)]) == 0  # re-rendered from results.json alone
    assert (out / "report.md").read_text() == report


def test_demo_refuses_a_foreign_non_empty_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_rejects_unknown_recipes(tmp_path):
    assert main(["demo", "--quick", "--out", str(tmp_path / "d"), "--recipes", "bf16,fp4"]) == 2
