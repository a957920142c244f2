"""The loop: exact resume, non-finite skipping, FP8 vs BF16-recipe training, eval, and the HF export."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import make_tiny_model
from infir2.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from infir2.harness.distributed import DistEnv
from infir2.train import NonFiniteError, train, train_step
from train_synthetic import CrashAfter, SyntheticSource, killed_and_resumed, one_thread, tiny_run_config

CPU = DistEnv(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_hybrid", "nvfp4"])
def test_resume_is_exact(tmp_path, recipe):
    """6 steps in one go == 3 steps, a crash, and a resume with fresh objects: identical losses.

    nvfp4's stochastic rounding draws from a generator seeded by (run seed, step, micro-batch)."""
    kw = {"train": {"max_steps": 6, "save_every": 3, "keep_last": 2}, "fp8": {"recipe": recipe}}
    full = train(
        tiny_run_config(tmp_path, "full", **kw),
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1),
        progress=False,
    )
    cfg = tiny_run_config(tmp_path, "split", **kw)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=make_tiny_model(), train_source=CrashAfter(3, seed=1), progress=False)
    assert latest_checkpoint(cfg.run_dir / "checkpoints").name == "step_00000003"
    # Fresh model (different init: the checkpoint must overwrite it), fresh source at position 0.
    resumed = train(
        cfg, model=make_tiny_model(seed=123), train_source=SyntheticSource(seed=1), progress=False
    )
    assert resumed.resumed_from.name == "step_00000003"
    assert [m["step"] for m in resumed.history] == [4, 5, 6]
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in full.history[3:]]  # bit-identical
    assert _losses(cfg.run_dir / "metrics.jsonl") == _losses(full.metrics_path)  # one clean curve
    assert [p.name for p in list_checkpoints(cfg.run_dir / "checkpoints")] == [
        "step_00000003",
        "step_00000006",
    ]
    a, b = load_checkpoint(full.checkpoint), load_checkpoint(resumed.checkpoint)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["data"] == [{"step": 6}] and b["scheduler"] == {"step": 6}


def test_nvfp4_resumes_identically_after_kill_9(tmp_path):
    """nvfp4 (stochastic rounding) killed by SIGKILL after step 3 and resumed in a fresh process: the
    same losses and weights as 6 uninterrupted steps."""
    resumed, full = killed_and_resumed(tmp_path, {"fp8": {"recipe": "nvfp4"}})
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in full.history[3:]]
    a, b = load_checkpoint(full.checkpoint), load_checkpoint(resumed.checkpoint)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_rerun_of_a_finished_run_resumes_at_its_end(tmp_path):
    cfg = tiny_run_config(tmp_path, train={"max_steps": 2})
    train(cfg, model=make_tiny_model(), train_source=SyntheticSource(seed=1), progress=False)
    again = train(cfg, model=make_tiny_model(), train_source=SyntheticSource(seed=1), progress=False)
    assert again.history == [] and again.step == 2 and again.resumed_from.name == "step_00000002"


def _poison_lm_head(model, when):
    """Make the logits NaN whenever ``when()`` is true (a stand-in for an FP8 overflow)."""

    def hook(module, args, output):
        return output * math.nan if when() else output

    return model.lm_head.register_forward_hook(hook)


def test_nonfinite_step_leaves_weights_untouched():
    model = make_tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _poison_lm_head(model, lambda: True)
    out = train_step(model, opt, next(iter(SyntheticSource())), 1e-2, 1.0, "fp32", CPU)
    assert out["skipped"] and math.isnan(out["loss"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    source = SyntheticSource(seed=1)
    model = make_tiny_model()
    _poison_lm_head(model, lambda: source.step in (2, 3))  # the 2nd and 3rd steps
    cfg = tiny_run_config(tmp_path, "skip", train={"max_steps": 5, "max_skipped_in_row": 3})
    result = train(cfg, model=model, train_source=source, progress=False)
    assert [m["skipped"] for m in result.history] == [False, True, True, False, False]
    assert result.history[-1]["skipped_total"] == 2
    adam_steps = load_checkpoint(result.checkpoint)["optimizer"]["state"]["lm_head.weight"]["step"]
    assert int(adam_steps) == 3  # two updates skipped

    source = SyntheticSource(seed=1)
    model = make_tiny_model()
    _poison_lm_head(model, lambda: source.step >= 2)
    cfg = tiny_run_config(tmp_path, "stop", train={"max_steps": 6, "max_skipped_in_row": 2})
    with pytest.raises(NonFiniteError, match="2 steps in a row"):
        train(cfg, model=model, train_source=source, progress=False)


def test_no_checkpoint_during_a_nonfinite_streak_and_the_abort_names_the_last_healthy_one(tmp_path):
    """A checkpoint every step, keep_last=1: the streak from step 3 on must not push out step 2's."""
    source = SyntheticSource(seed=1)
    model = make_tiny_model()
    _poison_lm_head(model, lambda: source.step >= 3)  # steps 3, 4, ... are non-finite
    cfg = tiny_run_config(
        tmp_path, "streak", train={"max_steps": 8, "save_every": 1, "keep_last": 1, "max_skipped_in_row": 3}
    )
    with pytest.raises(NonFiniteError) as e:
        train(cfg, model=model, train_source=source, progress=False)
    healthy = cfg.run_dir / "checkpoints" / "step_00000002"
    assert [p.name for p in list_checkpoints(cfg.run_dir / "checkpoints")] == [healthy.name]
    message = str(e.value)
    assert str(healthy) in message and "\n" not in message and isinstance(e.value, ValueError)


def _train_with_val(cfg):
    """The tiny model on synthetic data, with a held-out synthetic source for the evaluations."""
    return train(
        cfg,
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1),
        val_source=SyntheticSource(seed=99),
        progress=False,
    )


def _gaps_to_bf16(tmp_path, recipe):
    """10 steps of ``recipe`` and of bf16: both learn (training and held-out loss fall); the relative gap of
    ``recipe``'s loss to bf16's at every step."""
    losses = {}
    for name in ("bf16", recipe):
        cfg = tiny_run_config(
            tmp_path,
            name,
            fp8={"recipe": name},
            train={"max_steps": 10, "eval_every": 5},
            schedule={"warmup_fraction": 0.2, "decay_fraction": 0.4},
        )
        result = _train_with_val(cfg)
        losses[name] = [m["loss"] for m in result.history]
        assert [m["step"] for m in result.history if "val_loss" in m] == [5, 10]
        assert result.final_val_loss < result.history[4]["val_loss"]  # held-out loss falls
        assert sum(losses[name][-3:]) / 3 < losses[name][0] - 0.3  # training loss falls
    assert losses[recipe] != losses["bf16"]  # and the low-precision GEMMs really ran
    return [abs(a - b) / b for a, b in zip(losses[recipe], losses["bf16"], strict=True)]


@pytest.mark.slow
def test_fp8_blockwise_and_bf16_recipe_both_train_and_agree(tmp_path):
    # FP8 (E4M3, 1x128 / 128x128 scales) tracks the high-precision run: within 2% at every step
    gaps = _gaps_to_bf16(tmp_path, "blockwise")
    assert max(gaps) < 0.02, gaps


def test_nvfp4_trains_and_stays_near_bf16(tmp_path):
    """The NVFP4 recipe (E2M1 GEMMs, stochastically rounded gradients) learns, within 3% of the
    high-precision run at every step (4-bit elements: looser than FP8's 2%; measured: 1.1% at most)."""
    gaps = _gaps_to_bf16(tmp_path, "nvfp4")
    assert max(gaps) < 0.03, gaps


def test_eval_from_skips_the_early_evaluations_and_keeps_the_last(tmp_path):
    """``train.eval_from``: periodic evaluations start at that step; the last step is evaluated anyway."""
    cfg = tiny_run_config(
        tmp_path, train={"max_steps": 7, "eval_every": 2, "eval_from": 4, "eval_batches": 1}
    )
    result = _train_with_val(cfg)
    assert [m["step"] for m in result.history if "val_loss" in m] == [4, 6, 7]


def test_hf_export_loads_in_transformers(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_run_config(tmp_path, train={"max_steps": 1})
    result = train(
        cfg, model=make_tiny_model(), tokenizer=tiny_tokenizer, train_source=SyntheticSource(), progress=False
    )
    loaded = AutoModelForCausalLM.from_pretrained(result.hf_dir, local_files_only=True)
    trained = load_checkpoint(result.checkpoint)["model"]
    assert set(loaded.state_dict()) == set(trained)  # Fp8Linear saved as a plain nn.Linear model
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
    assert AutoTokenizer.from_pretrained(result.hf_dir).eos_token == "<|endoftext|>"
    saved = (cfg.run_dir / "config.yaml").read_text()
    assert "recipe: blockwise" in saved and (cfg.run_dir / "tensorboard").is_dir()
    row = json.loads(result.metrics_path.read_text().splitlines()[0])
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_gib"):
        assert isinstance(row[key], float) and row[key] > 0, key


def test_weights_only_load_starts_a_new_run_from_a_checkpoint(tmp_path):
    first = train(
        tiny_run_config(tmp_path, "a", fp8={"recipe": "bf16"}, train={"max_steps": 2}),
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1),
        progress=False,
    )
    cfg = tiny_run_config(
        tmp_path,
        "b",
        fp8={"recipe": "bf16"},
        train={"max_steps": 1},
        load={"path": str(first.checkpoint), "mode": "weights_only"},
    )
    second = train(cfg, model=make_tiny_model(seed=5), train_source=SyntheticSource(seed=1), progress=False)
    assert second.resumed_from == first.checkpoint and [m["step"] for m in second.history] == [1]
    # the loaded weights (not the seed-5 init) produced the first loss: it is the trained model's loss on step 1
    assert second.history[0]["loss"] < first.history[0]["loss"] - 0.05
    state = load_checkpoint(second.checkpoint)
    assert int(state["optimizer"]["state"]["lm_head.weight"]["step"]) == 1  # fresh AdamW
    assert second.tokens_per_s is not None and second.tokens_per_s > 0


def test_cpt_val_loss_is_the_number_eval_perplexity_prints(tmp_path):
    """One held-out loss: a CPT run's final val_loss (all of val.bin) equals evaluate_loss on its exported model."""
    import numpy as np

    from infir2.eval.perplexity import evaluate_loss

    rng = np.random.default_rng(0)
    data = tmp_path / "tokens"
    data.mkdir()
    rng.integers(0, 300, size=16 * 16).astype("<u2").tofile(data / "train.bin")
    rng.integers(0, 300, size=5 * 16 + 7).astype("<u2").tofile(
        data / "val.bin"
    )  # 5 full windows, a partial one
    (data / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    cfg = tiny_run_config(
        tmp_path,
        "cpt",
        train={"max_steps": 2, "eval_batches": 100},
        data={
            "kind": "cpt",
            "train_path": str(data),
            "seq_len": 16,
            "global_batch_size": 4,
            "micro_batch_size": 2,
        },
    )
    result = train(cfg, model=make_tiny_model(), progress=False)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(result.hf_dir, local_files_only=True, dtype=torch.float32)
    printed = evaluate_loss(exported, data, seq_len=16, batch_size=2)
    assert printed.tokens == 5 * 16 + 7 - 1  # every val token after the first, once
    assert result.final_val_loss == pytest.approx(printed.loss, rel=1e-5)


def test_a_killed_exports_leftover_is_removed_by_the_next_run(tmp_path):
    cfg = tiny_run_config(tmp_path, train={"max_steps": 2})
    train(cfg, model=make_tiny_model(), train_source=SyntheticSource(seed=1), progress=False)
    leftover = cfg.run_dir / ".tmp-hf-12345"  # what a kill -9 during export_model leaves
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    again = train(cfg, model=make_tiny_model(), train_source=SyntheticSource(seed=1), progress=False)
    assert not leftover.exists() and again.hf_dir.is_dir()


def test_a_failed_start_leaves_no_run_folder_it_created(tmp_path):
    cfg = tiny_run_config(tmp_path, "bad", data={"train_path": str(tmp_path / "no-such-data")})
    with pytest.raises(FileNotFoundError, match="no-such-data"):
        train(cfg, model=make_tiny_model(), progress=False)
    assert not cfg.run_dir.exists()
    cfg.run_dir.mkdir()
    (cfg.run_dir / "mine.txt").write_text("x")  # a folder the user made is never removed
    with pytest.raises(FileNotFoundError):
        train(cfg, model=make_tiny_model(), progress=False)
    assert (cfg.run_dir / "mine.txt").is_file()
