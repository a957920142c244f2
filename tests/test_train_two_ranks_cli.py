"""`torchrun -m infir2.cli train` on two CPU processes (gloo) with the defaults a user gets: DCP
checkpoints (train.checkpoint_format: auto) and a tiny validation split (prepare-cpt's default
--val-fraction 0.01: one validation batch for two ranks), whose loss is the one-process number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import make_tokenizer
from infir2.data import load_tokenizer, prepare_cpt
from train_synthetic import cpt_data, tiny_llama, torchrun

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    make_tokenizer().save_pretrained(root / "tok")
    docs = root / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": f"{i} + {i} = {2 * i}. The fox counts to {i}."}) + "\n" for i in range(600)
        )
    )
    meta = prepare_cpt([docs], root / "cpt", load_tokenizer(root / "tok"), progress=False)  # default: 1% val
    assert meta["val_documents"] == 6
    config = {
        "run": {"name": "two", "out_dir": str(root / "runs"), "device": "cpu"},
        "model": {"from_config": tiny_llama(), "tokenizer": str(root / "tok"), "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "data": cpt_data(root / "cpt", 64, 8, 4),
        "train": {"max_steps": 2},
    }
    (root / "two.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "infir2.cli", "train", str(root / "two.yaml"), "--no-progress")
    return root, root / "runs" / "two"


@pytest.mark.slow
def test_several_processes_write_dcp_checkpoints_by_default(two_rank_run):
    _, run = two_rank_run
    final = run / "checkpoints" / "step_00000002"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["format"] == "dcp" and meta["world_size"] == 2
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    assert not (final / "state.pt").exists()  # nothing gathered to rank 0
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["checkpoint_format"] == "dcp"
    assert (run / "hf" / "model.safetensors").is_file()  # the export streams from the shards


@pytest.mark.slow
def test_a_tiny_validation_split_gives_the_one_process_loss_on_two_ranks(two_rank_run):
    """6 held-out documents = 3 windows = one batch of 4: rank 1 has no window of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    from infir2.data import val_batches
    from infir2.loss import heldout_loss

    root, run = two_rank_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    two_ranks = rows[-1]["val_loss"]  # the last step is evaluated
    assert len(list(val_batches(root / "cpt", 64, 4))) == 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)  # the final weights
    one_process, tokens = heldout_loss(model, ([mb] for mb in val_batches(root / "cpt", 64, 4)))
    assert tokens > 0 and two_ranks == pytest.approx(one_process, rel=1e-5)
