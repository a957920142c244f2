"""`infir2 train` end to end on real data files: CPT from scratch, a decay-only branch, then SFT on the export."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import make_tokenizer
from infir2.checkpoint import load_checkpoint
from infir2.cli import main
from infir2.data import prepare_cpt
from train_synthetic import cpt_data, one_thread, tiny_llama

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slow
def test_cpt_decay_only_and_sft_through_the_command(tmp_path):
    tok_dir = tmp_path / "tokenizer"
    make_tokenizer().save_pretrained(tok_dir)
    from infir2.data import load_tokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": f"{i} + {i} = {2 * i}. The fox counts to {i}."}) + "\n" for i in range(300)
        )
    )
    prepare_cpt([docs], tmp_path / "cpt", load_tokenizer(tok_dir), val_fraction=0.1, progress=False)
    cpt = {
        "run": {"name": "cpt", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"from_config": tiny_llama(), "tokenizer": str(tok_dir), "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "data": cpt_data(tmp_path / "cpt", 32, 4, 2),
        "optim": {"lr": 3e-3},
        "schedule": {"name": "wsd", "warmup_steps": 1, "decay_steps": 2},
        "train": {"max_steps": 4, "save_every": 2, "eval_every": 2, "eval_batches": 2},
    }
    assert main(["train", _write(tmp_path / "cpt.yaml", cpt), "--no-progress"]) == 0
    run = tmp_path / "runs" / "cpt"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val_loss" in rows[1] and "val_loss" in rows[3]
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 3e-3

    # decay-only: the stable-phase checkpoint at step 2, a fresh 3-step linear decay, --set typed overrides
    ckpt = run / "checkpoints" / "step_00000002"
    overrides = [
        "run.name=decay",
        "load.mode=decay_only",
        "load.reset_step=true",
        "train.max_steps=3",
        "schedule.warmup_steps=0",
        "schedule.decay_steps=3",
        "schedule.decay_style=linear",
        "schedule.min_lr=3e-4",
    ]
    args = ["train", str(tmp_path / "cpt.yaml"), "--load", str(ckpt), "--no-progress"]
    assert main(args + [x for o in overrides for x in ("--set", o)]) == 0
    decay = [json.loads(line) for line in (tmp_path / "runs/decay/metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in decay] == pytest.approx(
        [3e-3, 3e-3 - (3e-3 - 3e-4) / 3, 3e-3 - 2 * (3e-3 - 3e-4) / 3]
    )
    stable = load_checkpoint(ckpt)
    state = load_checkpoint(tmp_path / "runs/decay/checkpoints/step_00000003")
    assert state["data"][0]["step_in_epoch"] == stable["data"][0]["step_in_epoch"] + 3  # data continued
    adam = state["optimizer"]["state"]["lm_head.weight"]["step"]
    assert int(adam) == 2 + 3  # the stable run's AdamW moments were loaded and carried on

    # SFT on the CPT export (a plain HF folder with the tokenizer)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Please reason step by step."},
                        {"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"{i} + {i} = {2 * i}. The answer is {2 * i}."},
                    ]
                }
            )
            + "\n"
            for i in range(40)
        )
    )
    sft = {
        "run": {"name": "sft", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(run / "hf"), "precision": "fp32"},
        "data": {
            "kind": "sft",
            "train_path": str(chats),
            "val_path": str(chats),
            "global_batch_size": 8,
            "max_tokens_per_micro_batch": 256,
            "max_length": 128,
            "epochs": 2,
        },
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "schedule": {"name": "cosine", "warmup_fraction": 0.1, "min_lr_ratio": 0.1},
        "train": {"eval_batches": 1},
    }
    assert main(["train", _write(tmp_path / "sft.yaml", sft), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs/sft/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (40 // 8)  # max_steps from the data: 5 steps per epoch, 2 epochs
    assert rows[-1]["lr"] < rows[2]["lr"] and "val_loss" in rows[-1]
    assert (tmp_path / "runs/sft/hf/model.safetensors").is_file()


def test_command_reports_config_errors(tmp_path, capsys):
    path = _write(tmp_path / "bad.yaml", {"model": {"path": "m"}, "optim": {"lrr": 1}})
    assert main(["train", path]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and str(path) in err and "unknown key" in err
