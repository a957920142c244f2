"""Peak RSS of one training step at Qwen2.5's vocabulary, for one or more source trees side by side
(issue 56's regression: the token scorer's backward held three ``[chunk, V]`` fp32 blocks at once).

The step is what ``infir2 train`` runs on a CPU (``model.precision: fp32``): a 1-layer Qwen2 of width
``--hidden`` (intermediate ``4 x hidden``, 4 / 2 heads) with 151,936 words (tied embedding), FP8
``blockwise``, the weight cache on, one micro-batch of ``--tokens`` random tokens through
``infir2.loss.token_ce_sum`` (``train.loss_chunk_tokens: auto``: 441 tokens per chunk at this
vocabulary), backward, gradient clipping and one AdamW step (fp32 moments). Each tree's step runs in
its own process under ``/usr/bin/time -f %M`` (the process's peak RSS, torch included), one thread.
The table prints that peak (KiB, and GB of 1e9 bytes against the 2.0 GB budget), its ratio to the
first tree's, the process's high-water mark (``VmHWM``, never reset) after the forward, after the
backward and after the step (the phase where it last rises holds the peak), the loss and the gradient
norm (equal bits across trees whose scorer computes the same numbers).

    OMP_NUM_THREADS=1 python benchmarks/train_step_memory.py                        # this checkout
    OMP_NUM_THREADS=1 python benchmarks/train_step_memory.py --src /tmp/old/src,src  # before, after

``--src`` takes ``src`` folders of other checkouts (``git worktree add /tmp/old COMMIT``); each
child imports ``infir2`` from its own tree, this script's code is the same for all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from infir2.tools.machine import cpu_description

GB = 1e9  # /usr/bin/time's %M is in KiB (ru_maxrss); printed as it is and in GB (1e9 bytes)
BUDGET_GB = 2.0  # the step's peak this project set itself at this shape (BENCHMARKS.md)


def child(hidden: int, tokens: int) -> dict:
    import resource
    import time

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infir2.harness.optim import build_optimizer
    from infir2.loss import token_ce_sum
    from infir2.model import prepare_for_training
    from infir2.nn import cache_fp8_weights
    from infir2.train.config import OptimConfig

    torch.set_num_threads(1)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = prepare_for_training(Qwen2ForCausalLM(config), "blockwise")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    t0, phases = time.perf_counter(), {}
    with cache_fp8_weights(model):
        loss = token_ce_sum(model, {"input_ids": ids, "labels": ids}, "fp32", torch.device("cpu")) / tokens
        phases["forward"] = _hwm_kb()
        loss.backward()
        phases["backward"] = _hwm_kb()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    phases["step"] = _hwm_kb()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = time.perf_counter() - t0
    return {
        "loss": loss.item(),
        "grad_norm": norm.item(),
        "seconds": seconds,
        "ru_kb": peak_kb,
        "phases": phases,
    }


def _hwm_kb() -> int:
    """This process's peak RSS so far (``VmHWM``), in KiB."""
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1])


def _commit(src: Path) -> str:
    run = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True, text=True
    )
    return (run.stdout.strip() or "?") + ("+changes" if dirty.stdout.strip() else "")


def _run(src: Path, hidden: int, tokens: int) -> dict:
    """One child under ``/usr/bin/time -f %M``, importing ``infir2`` from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, __file__, "--child"]
    cmd += ["--hidden", str(hidden), "--tokens", str(tokens)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        raise SystemExit(f"{src}: the step failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {**result, "time_kb": int(run.stderr.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"), help="comma-separated")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.hidden, args.tokens)))
        return
    import torch

    print(
        f"CPU: {cpu_description()}, {os.cpu_count()} cores; torch {torch.__version__}; Python {platform.python_version()}; one thread"
    )
    print(f"1-layer Qwen2, hidden {args.hidden}, vocab 151936 (tied), {args.tokens} tokens, blockwise, fp32")
    print(
        f"{'tree':<20}{'commit':>16}{'%M KiB':>10}{'peak GB':>9}{'ratio':>7}{'2.0 GB':>7}"
        f"{'fwd GB':>8}{'bwd GB':>8}{'step GB':>8}{'seconds':>9}  loss, grad norm"
    )
    first = None
    for src in (Path(s) for s in args.src.split(",")):
        r = _run(src, args.hidden, args.tokens)
        peak = r["time_kb"] * 1024 / GB
        first = first or peak
        fits = "under" if peak < BUDGET_GB else "OVER"
        phases = "".join(f"{r['phases'][k] * 1024 / GB:>8.2f}" for k in ("forward", "backward", "step"))
        print(
            f"{src!s:<20}{_commit(src):>16}{r['time_kb']:>10}{peak:>9.2f}{peak / first:>7.3f}{fits:>7}"
            f"{phases}{r['seconds']:>9.1f}  {r['loss']!r}, {r['grad_norm']!r}"
        )


if __name__ == "__main__":
    main()
