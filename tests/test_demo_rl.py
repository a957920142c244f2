"""`infir2 demo --rl` (demo/rl.py): the demo's SFT model through RL, both precision pairs over RL seeds,
the figure and the verdict; the held-out problems never among the RL prompts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import make_tiny_model
from infir2.cli import main
from infir2.tools.demo.data import harder
from infir2.tools.demo.pipeline import QUICK, prepare_data
from infir2.tools.demo.rl import QUICK_STUDY, _every_run, _problems, start_model
from infir2.tools.demo.rl_results import weight_views
from infir2.tools.paired import paired_verdict


@pytest.mark.slow
def test_demo_rl_reuses_the_demos_sft_model_and_writes_figure_and_verdict(tmp_path, capsys):
    out = tmp_path / "demo"
    _, tok = prepare_data(out, QUICK)  # what `infir2 demo --quick` leaves: data and tokenizer
    sft = out / "runs" / "bf16" / "s0" / "sft" / "hf"
    make_tiny_model(vocab_size=len(tok), tie=True).save_pretrained(sft)  # the start (reused, not trained)
    tok.save_pretrained(sft)
    assert main(["demo", "--rl", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "rl" / "results.json").read_text())
    assert record["start"] == str(sft)
    assert [(r["pair"], r["seed"]) for r in record["runs"]] == [
        (p, s) for s in (0, 1) for p in ("fp8:blockwise", "high:bf16")
    ]
    for r in record["runs"]:
        assert r["val"][0][0] == 0 and [s for s, _ in r["val"][1:]] == [1, 2]  # start, then every step
        assert r["steps"] == [1, 2] and len(r["kl_ref"]) == 2  # the KL to the start, logged every step
        assert (out / "rl" / "runs" / f"{r['pair'].replace(':', '-')}-s{r['seed']}" / "hf").is_dir()
    fp8 = {r["seed"]: r for r in record["runs"] if r["pair"] == "fp8:blockwise"}
    bf16 = {r["seed"]: r for r in record["runs"] if r["pair"] == "high:bf16"}
    gains = [100 * (fp8[s]["val"][-1][1] - fp8[s]["val"][0][1]) for s in (0, 1)]
    first = record["verdicts"][0]
    assert first["what"] == "fp8:blockwise: RL - SFT start"
    assert first["label"] == paired_verdict(gains, 3.0, True).label and first["n"] == 2
    rows = {v["what"]: v for v in record["verdicts"]}
    diff = [100 * (fp8[s]["val"][-1][1] - bf16[s]["val"][-1][1]) for s in (0, 1)]
    assert rows["fp8:blockwise - high:bf16 after RL"]["mean"] == pytest.approx(sum(diff) / 2)
    bf16_gains = [100 * (bf16[s]["val"][-1][1] - bf16[s]["val"][0][1]) for s in (0, 1)]
    gain_diff = [a - b for a, b in zip(gains, bf16_gains, strict=True)]
    row = rows["fp8:blockwise - high:bf16, gain over the start"]
    assert row["mean"] == pytest.approx(sum(gain_diff) / 2)
    assert row["label"] == paired_verdict(gain_diff, 3.0, True).label
    assert len(rows) == len(record["verdicts"]) == 4
    for r in record["runs"]:  # the projections' views of RL's move (weight_views' own test: below)
        assert set(r["weight_views"]) == {
            "fp8_changed",
            "fp8_error",
            "bf16_changed",
            "bf16_error",
            "logit_scale",
        }
    assert "seen in FP8 (128x128 E4M3)" in printed
    assert (out / "rl" / "rl.png").stat().st_size > 10_000
    assert "verdict" in printed and "fp8:blockwise - high:bf16 after RL" in printed
    prompts = {json.loads(x)["problem"] for x in (out / "rl" / "prompts.jsonl").read_text().splitlines()}
    held_out = {json.loads(x)["problem"] for x in (out / "rl" / "val.jsonl").read_text().splitlines()}
    assert prompts and held_out and not prompts & held_out


def test_demo_rl_refuses_flags_it_does_not_use(tmp_path, capsys):
    assert main(["demo", "--rl", "--report-only", "--out", str(tmp_path)]) == 2
    assert "--rl" in capsys.readouterr().err


def test_a_failed_rl_run_lets_the_others_finish_then_is_named_and_raised(tmp_path, caplog):
    keys = [("fp8:blockwise", 0), ("high:bf16", 0), ("fp8:blockwise", 1), ("high:bf16", 1)]
    configs = {k: {"run": {"name": f"{k[0]}-s{k[1]}", "out_dir": str(tmp_path)}} for k in keys}
    ran = []

    def run(key):
        ran.append(key)
        if key[1] == 0 and key[0] == "high:bf16":
            raise ValueError("loss is not finite at step 7")
        return {"val": [(0, 0.5)]}

    assert _every_run({k: lambda k=k: run(k) for k in keys[:1] + keys[2:]}, configs) == {
        k: {"val": [(0, 0.5)]} for k in keys[:1] + keys[2:]
    }
    ran.clear()
    with pytest.raises(ValueError, match="loss is not finite at step 7"), caplog.at_level("ERROR"):
        _every_run({k: lambda k=k: run(k) for k in keys}, configs)
    assert ran == keys  # the runs after the failed one ran too
    assert str(tmp_path / "high:bf16-s0") in caplog.text and "1 of 4 RL runs failed" in caplog.text
    assert "fp8:blockwise-s1" not in caplog.text.split("failed (")[1]  # only the failed run is named


def _ops(problem: str) -> int:
    return sum(problem.count(op) for op in "+-*")


@pytest.mark.parametrize("split, hard_share", [("hard", 1.0), ("mixed", 0.5), ("two-op", 0.0)])
def test_study_splits_hold_out_apart_and_in_their_shares(tmp_path, split, hard_share):
    out = tmp_path / "demo"
    prepare_data(out, QUICK)
    study = dataclasses.replace(QUICK_STUDY, split=split, n_prompts=40, n_val=10)
    prompts_path, val_path = _problems(out, QUICK, study)
    prompts = [json.loads(x)["problem"] for x in prompts_path.read_text().splitlines()]
    val = [json.loads(x)["problem"] for x in val_path.read_text().splitlines()]
    test = [json.loads(x)["problem"] for x in (out / "data" / "test.jsonl").read_text().splitlines()]
    two_ops = set(range(QUICK.num_ops[0], QUICK.num_ops[1] + 1))
    assert (
        len(prompts) == 40 and len(val) == 10 and not set(prompts) & set(val) and not set(prompts) & set(test)
    )
    assert sum(_ops(p) not in two_ops for p in prompts) == int(40 * hard_share)
    assert sum(_ops(p) not in two_ops for p in val) == int(10 * hard_share)
    assert [p for p in val if _ops(p) in two_ops] == test[: 10 - int(10 * hard_share)]  # the demo's own first


def test_a_start_of_its_own_length_is_trained_from_the_baselines_cpt(tmp_path):
    out = tmp_path / "demo"
    _, tok = prepare_data(out, QUICK)
    cpt = out / "runs" / "bf16" / "s0" / "cpt" / "hf"
    make_tiny_model(vocab_size=len(tok), tie=True).save_pretrained(cpt)  # the baseline's CPT (reused)
    tok.save_pretrained(cpt)
    study = dataclasses.replace(QUICK_STUDY, start_epochs=2, start_lr=1e-3)
    hf = start_model(out, QUICK, study)
    assert hf == out / "runs" / "bf16" / "s0" / "sft-2ep-lr0.001" / "hf" and (hf / "config.json").is_file()
    saved = (hf.parent / "config.yaml").read_text()
    assert "epochs: 2" in saved and "lr: 0.001" in saved and str(cpt) in saved
    assert not (
        out / "runs" / "bf16" / "s0" / "sft"
    ).exists()  # the demo's own SFT is neither run nor touched
    assert start_model(out, QUICK, study) == hf  # reused


def test_a_start_of_its_own_length_without_a_cpt_trains_the_cpt_alone_first(tmp_path):
    out = tmp_path / "demo"
    study = dataclasses.replace(QUICK_STUDY, start_epochs=2)
    hf = start_model(out, QUICK, study)
    seed_dir = out / "runs" / "bf16" / "s0"
    assert hf == seed_dir / f"sft-2ep-lr{QUICK.sft_lr:g}" / "hf" and (hf / "config.json").is_file()
    assert (seed_dir / "cpt" / "hf" / "config.json").is_file()
    assert not (seed_dir / "sft").exists() and not (seed_dir / "eval").exists()  # no baseline SFT, no eval


def test_a_start_with_harder_conversations_mixed_in_trains_on_them_and_never_on_held_out(tmp_path):
    out = tmp_path / "demo"
    data, tok = prepare_data(out, QUICK)
    cpt = out / "runs" / "bf16" / "s0" / "cpt" / "hf"
    make_tiny_model(vocab_size=len(tok), tie=True).save_pretrained(cpt)
    tok.save_pretrained(cpt)
    study = dataclasses.replace(QUICK_STUDY, start_hard=12, split="hard", n_val=30)
    hf = start_model(out, QUICK, study)
    assert hf == out / "runs" / "bf16" / "s0" / f"sft-{QUICK.sft_epochs}ep-lr{QUICK.sft_lr:g}-hard12" / "hf"
    mixed = out / "data" / "sft_train_hard12.jsonl"
    assert str(mixed) in (hf.parent / "config.yaml").read_text()  # the SFT read the mixed file
    demo_lines = data["sft_train"].read_text().splitlines()
    lines = mixed.read_text().splitlines()
    questions = [json.loads(x)["messages"][1]["content"] for x in lines]
    extra = [q for q in questions if _ops(q) == harder(QUICK.num_ops)[0]]
    assert len(lines) == len(demo_lines) + 12 and len(extra) == len(set(extra)) == 12
    assert set(demo_lines) <= set(lines)
    held_out = {json.loads(x)["problem"] for x in (out / "rl" / "val.jsonl").read_text().splitlines()}
    assert len(held_out) == 30 and not held_out & set(questions)
    for x in lines:  # each a conversation whose boxed answer is the question's value (left to right)
        m = json.loads(x)["messages"]
        terms = m[1]["content"].removeprefix("Compute ").removesuffix(".").split()
        value = int(terms[0])
        for op, b in zip(terms[1::2], terms[2::2], strict=True):
            value = value + int(b) if op == "+" else value - int(b)
        assert m[2]["content"].endswith(f"\\boxed{{{value}}}.")
    assert not (out / "runs" / "bf16" / "s0" / "sft").exists()
    assert start_model(out, QUICK, study) == hf  # reused: its SFT saw none of the held-out problems
    # a reused start whose SFT saw a problem this study holds out is refused, naming the file
    lines[0] = json.dumps(
        {"messages": [{"role": "user", "content": ""}, {"role": "user", "content": sorted(held_out)[0]}]}
    )
    mixed.write_text("".join(x + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"sft_train_hard12\.jsonl: the reused start's SFT has 1 of"):
        start_model(out, QUICK, study)


def test_weight_views_measure_how_much_of_a_move_survives_rounding(tmp_path):
    """Moves made by hand, each weight by +-size x the mean |weight|: at half the mean, both views follow
    the move (small error, every value changed); at 1% (about an RL run's here), most FP8 values stay
    and those that change jump a whole FP8 step, so the FP8 view's move is mostly rounding, while the
    bf16 view follows it; the final norm scaled by hand reads back as the logit scale; no move, nothing
    changed."""
    import torch

    torch.manual_seed(0)
    make_tiny_model(seed=1).save_pretrained(tmp_path / "start")

    def moved(name: str, size: float, norm_scale: float = 1.0) -> dict[str, float]:
        model = make_tiny_model(seed=1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("proj.weight"):
                    p.add_(size * p.abs().mean() * torch.sign(torch.randn_like(p)))
            model.model.norm.weight.mul_(norm_scale)
        model.save_pretrained(tmp_path / name)
        return weight_views(tmp_path / "start", tmp_path / name)

    big, small = moved("big", 0.5, norm_scale=1.25), moved("small", 0.01)
    assert big["logit_scale"] == pytest.approx(1.25) and small["logit_scale"] == 1.0
    assert big["fp8_error"] < 0.2 and big["fp8_changed"] > 0.95 and big["bf16_error"] < 0.05
    assert small["fp8_error"] > 2 and small["fp8_changed"] < 0.4
    assert small["bf16_error"] < 0.5 and small["bf16_changed"] > 0.9
    same = weight_views(tmp_path / "start", tmp_path / "start")
    assert same == {
        "fp8_changed": 0.0,
        "fp8_error": 0.0,
        "bf16_changed": 0.0,
        "bf16_error": 0.0,
        "logit_scale": 1.0,
    }
