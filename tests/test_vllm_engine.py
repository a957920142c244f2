"""The vllm engine against a real vLLM (marker ``vllm``: .ci/vllm-env builds vLLM's CPU build and runs these).

* ``infir2 eval --engine vllm``: greedy samples equal the built-in engine's, sample by sample;
* ``infir2 eval --engine server`` against vLLM's own OpenAI server: equal too;
* ``infir2 rl`` with ``rollout.engine: vllm`` (a tied ``lm_head``: the refit must reach it): after every
  refit the engine's log-probabilities equal the trainer's to float rounding (no drift), while a control
  run whose engine keeps its first weights drifts by orders of magnitude more;
* the same run killed with ``kill -9`` after its second checkpoint and rerun ends identical to the
  uninterrupted run: every metric (timings aside) and every tensor of the final checkpoint.

Every vLLM runs in a subprocess of its own (one ``vllm.LLM`` per process, as a user runs the command).
Without vLLM (the main suite) these are skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_tiny_model, make_tokenizer
from rl_runs import fingerprint
from transformers_server import free_port

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (bash .ci/vllm-env)"),
    pytest.mark.timeout(900),
]

TESTS = Path(__file__).resolve().parent
STEPS = 3
#: the engine's and the trainer's log-probabilities of the same tokens with the same fp32 weights differ by
#: float rounding only (measured: ~5e-7); a stale engine (no refit) differs by 1e-2 and more at lr 1e-3
NO_DRIFT = 1e-4


def _env() -> dict[str, str]:
    src = str(Path(__import__("infir2").__file__).parents[1])
    path = os.pathsep.join([src, str(TESTS)])
    # on a CPU, vLLM reserves --gpu-memory-utilization of the RAM unless given a KV cache size (GiB)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny fp32 Qwen2 with a tied lm_head, saved with its tokenizer as AutoTokenizer reloads it."""
    from transformers import AutoTokenizer

    from infir2.export import export_model

    root = tmp_path_factory.mktemp("vllm")
    model = make_tiny_model(hidden=128, tie=True, seed=1)
    out = export_model(model, make_tokenizer(), root / "fp32", fmt="fp32")
    AutoTokenizer.from_pretrained(out).save_pretrained(out)
    return out


def _eval(folder: Path, out: Path, *engine: str) -> list[dict]:
    cmd = [sys.executable, "-m", "infir2.cli", "eval", "--model", str(folder), "--greedy"]
    _run([*cmd, "--max-new-tokens", "24", "--out", str(out), *engine])
    return _read(out / "samples.jsonl")


@pytest.fixture(scope="module")
def builtin(folder: Path, tmp_path_factory) -> list[dict]:
    return _eval(folder, tmp_path_factory.mktemp("builtin") / "out")


def test_eval_engine_vllm_greedy_equals_the_builtin_engine(folder, builtin, tmp_path):
    served = _eval(folder, tmp_path / "vllm", "--engine", "vllm")
    assert len(builtin) == 8 and served == builtin  # text, token count, finished, answer, verdict
    summary = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["precision"] == "high (vLLM)"


def test_eval_engine_server_against_vllms_openai_server_equals_it_too(folder, builtin, tmp_path):
    port = free_port()
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    server += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [*server, "--max-model-len", "512"], env=_env(), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM's server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        url = ["--engine", "server", "--base-url", f"http://127.0.0.1:{port}", "--concurrency", "2"]
        served = _eval(folder, tmp_path / "server", *url)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert served == builtin


def _prompts(path: Path) -> str:
    lines = [json.dumps({"problem": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)}) for i in range(8)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(folder: Path, root: Path, name: str) -> Path:
    cfg = {
        "run": {"name": name, "out_dir": str(root / "runs"), "device": "cpu"},
        "model": {"path": str(folder), "precision": "fp32"},
        "fp8": {"recipe": "bf16"},
        "optim": {"lr": 1e-3},
        "data": {"prompts_path": _prompts(root / "prompts.jsonl")},
        "rollout": {
            "engine": "vllm",
            "precision": "high",
            "prompts_per_step": 2,
            "group_size": 4,
            "oversample_prompts": 3,
            "max_new_tokens": 8,
            "batch_size": 8,
            "carry_over": False,  # a carried group was sampled by the weights before the update: off-policy
        },
        "algo": {"reward": "parity", "overlong": "none", "micro_batch_size": 8},
        "train": {"max_steps": STEPS, "save_every": 1, "keep_last": 5, "max_prob_error": None},
        "vllm": {"max_model_len": 256, "cpu_kv_cache_gib": 0.5},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rl(config: Path, *flags: str) -> list[str]:
    return [sys.executable, str(TESTS / "vllm_rl_worker.py"), str(config), *flags]


@pytest.fixture(scope="module")
def reference(folder: Path, tmp_path_factory) -> Path:
    """The uninterrupted run, with a refit after every step."""
    root = tmp_path_factory.mktemp("rl")
    _run(_rl(_config(folder, root, "ref")))
    return root / "runs" / "ref"


def test_rl_on_vllm_refits_every_step_and_the_mismatch_stays_at_float_rounding(reference):
    metrics = _read(reference / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["updates"] == 1 and "skipped" not in m for m in metrics)  # the policy moved every step
    for m in metrics:
        assert m["mismatch/abs_dlogp_max"] < NO_DRIFT, m
        assert m["token_mult_prob_error"] == m["mismatch/prob_error"] < 1 + NO_DRIFT
        assert m["refit_time_s"] > 0
    print("mismatch/abs_dlogp_max per step:", [m["mismatch/abs_dlogp_max"] for m in metrics])
    print("mismatch/abs_dlogp_mean per step:", [m["mismatch/abs_dlogp_mean"] for m in metrics])
    print("refit_time_s per step:", [m["refit_time_s"] for m in metrics])


def test_rl_on_vllm_without_refit_drifts(folder, reference, tmp_path):
    _run(_rl(_config(folder, tmp_path, "stale"), "--no-refit"))
    stale, fresh = _read(tmp_path / "runs" / "stale" / "metrics.jsonl"), _read(reference / "metrics.jsonl")
    assert stale[0]["mismatch/abs_dlogp_max"] < NO_DRIFT  # step 1: the first load is the policy itself
    for m in stale[1:]:  # after an update the engine's weights are stale
        assert m["mismatch/abs_dlogp_mean"] > 100 * max(f["mismatch/abs_dlogp_mean"] for f in fresh), m
    print("stale mismatch/abs_dlogp_mean per step:", [m["mismatch/abs_dlogp_mean"] for m in stale])


def test_rl_on_vllm_killed_with_sigkill_resumes_identical(folder, reference, tmp_path):
    config = _config(folder, tmp_path, "killed")
    run_dir = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(
        _rl(config), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 600
    # killed once step 1 is saved: two steps still to run, so the kill lands before the end even on a
    # fast machine (after step 2's checkpoint, the last step could finish within one poll)
    while not (run_dir / "checkpoints" / "step_00000001").is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_read(run_dir / "metrics.jsonl")) < STEPS  # killed before the end
    _run(_rl(config))
    metrics, tensors = fingerprint(run_dir)
    want_metrics, want_tensors = fingerprint(reference)
    assert metrics == want_metrics
    assert tensors.keys() == want_tensors.keys()
    for name, t in want_tensors.items():
        assert torch.equal(tensors[name], t), name
    assert not list(run_dir.rglob(".tmp-*"))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="FP8 on vLLM runs on a GPU only here: vLLM's CPU block-FP8 kernel needs AMX, and with AMX it "
    "VNNI-repacks the codes (not the export's bytes); this has not run yet (no GPU lent)",
)
def test_fp8_rollouts_on_vllm_hold_the_fp8_exports_bytes(tmp_path):
    """Whole 128-blocks (head_dim 128): after a refit of changed weights, the codes and scales vLLM holds
    (read back) equal the bytes `infir2 export --format fp8` writes for the same weights."""
    from safetensors.torch import load_file

    from infir2.export import export_model
    from infir2.generation.vllm_engine import VllmEngine, VllmSettings, check_fp8_bytes

    tokenizer = make_tokenizer()
    policy = make_tiny_model(hidden=256, intermediate=512, heads=2, kv_heads=1, seed=4)
    engine = VllmEngine(tokenizer, VllmSettings(memory_fraction=0.2), policy=policy, precision="fp8")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine.load_weights(policy)
    folder = export_model(policy, tokenizer, tmp_path / "fp8", fmt="fp8")
    exported = {}
    for f in sorted(folder.glob("*.safetensors")):
        exported |= load_file(str(f))
    assert check_fp8_bytes(engine.held_fp8(), exported) == []
