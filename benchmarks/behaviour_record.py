"""A digest of what infir2's stages compute, to compare a refactor's tree with the tree before it.

Runs, on CPU with one thread per process:

* ``rl1``: a tiny `infir2 rl` run (3 steps, FP8 rollouts, blockwise training, a KL reference, carried-over
  groups, a checkpoint every step) in one process;
* ``rl2``: the same run under ``torchrun --nproc_per_node 2`` (gloo, FSDP2);
* ``train``: a tiny CPT run (6 steps, blockwise) in one process;

and writes, per run, every metric of ``metrics.jsonl`` except timings and memory, and the SHA-256 of
every tensor of the final ``hf/`` export and of the last checkpoint's model. Two trees compute the same
thing exactly when their digests are equal (``--compare A.json B.json``). Usage::

    python benchmarks/behaviour_record.py --out before.json      # on the old tree
    python benchmarks/behaviour_record.py --out after.json       # on the new tree
    python benchmarks/behaviour_record.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path[:0] = [str(ROOT / "src"), str(TESTS)]

#: metric suffixes that depend on the machine's load, not on what is computed
TIMINGS = ("_time_s", "peak_mem_gib", "tokens_per_s")


def _digest_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    out = {}
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
        out[name] = f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]}"
    return out


def _run_digest(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in m.items() if not k.endswith(TIMINGS)} for m in metrics]
    hf = {}
    for f in sorted((run_dir / "hf").glob("*.safetensors")):
        hf.update(load_file(f))
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state = torch.load(last / "state.pt", weights_only=True) if (last / "state.pt").exists() else None
    return {
        "metrics": metrics,
        "hf": _digest_tensors(hf),
        "checkpoint": last.name,
        "checkpoint_model": _digest_tensors(state["model"]) if state else "dcp",
    }


def _rl_config(tmp: Path) -> Path:
    """The config of tests/test_rl_distributed.py (its 2-process test's run)."""
    from conftest import make_tokenizer
    from infir2.eval import register_grader
    from rl_distributed_worker import parity
    from test_rl_distributed import _config

    register_grader("parity", parity)  # the test's reward, as the worker registers it
    return _config(tmp, make_tokenizer())


def _env() -> dict[str, str]:
    from train_synthetic import subprocess_env

    return subprocess_env()


_RL_ONE = """
import sys
from infir2.cli import main
from infir2.eval import register_grader
from rl_distributed_worker import parity
register_grader("parity", parity)
import torch; torch.set_num_threads(1)
sys.exit(main(["rl", sys.argv[1], "--no-progress", "--set", "run.name=one"]))
"""


def record_rl(tmp: Path) -> dict:
    cfg = _rl_config(tmp)
    subprocess.run([sys.executable, "-c", _RL_ONE, str(cfg)], env=_env(), check=True, timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(TESTS / "rl_distributed_worker.py"), str(cfg), "--set", "run.name=two"]
    subprocess.run(cmd, env=_env(), check=True, timeout=600, capture_output=True)
    return {"rl1": _run_digest(tmp / "runs" / "one"), "rl2": _run_digest(tmp / "runs" / "two")}


def record_train(tmp: Path) -> dict:
    from conftest import make_tiny_model
    from infir2.train import train
    from train_synthetic import SyntheticSource, tiny_run_config

    torch.set_num_threads(1)
    cfg = tiny_run_config(tmp / "train", "cpt", train={"max_steps": 6, "save_every": 3})
    train(
        cfg,
        model=make_tiny_model(vocab_size=64),
        train_source=SyntheticSource(64, 32, seed=3),
        progress=False,
    )
    return {"train": _run_digest(cfg.run_dir)}


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    bad = 0
    for run in sorted(set(a) | set(b)):
        if a.get(run) == b.get(run):
            print(f"{run}: identical ({len(a[run]['metrics'])} steps, {len(a[run]['hf'])} exported tensors)")
            continue
        bad += 1
        for part in ("metrics", "hf", "checkpoint", "checkpoint_model"):
            if a.get(run, {}).get(part) != b.get(run, {}).get(part):
                print(f"{run}: {part} differs")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the digest here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out FILE or --compare A B")
    with tempfile.TemporaryDirectory() as d:
        record = record_rl(Path(d)) | record_train(Path(d))
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {', '.join(record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
