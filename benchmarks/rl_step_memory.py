"""Peak memory of one ``infir2 rl`` step against response length and vocabulary, beside the bytes the
full-vocabulary scoring would need, and the time per scored token, chunked vs unchunked.

Each case runs one RL step (``infir2.rl.rl``, ``train.max_steps: 1``) in its own subprocess (one
high-water mark cannot hide another) on a 1-layer Qwen2 of width ``--hidden`` with ``--vocab`` words:
one prompt, a group of ``--batch`` responses of up to ``--lengths`` tokens (FP8 rollouts from the
built-in engine, which copies the model; no dynamic sampling, so the group is trained on whatever its
rewards), ``micro_batch_size`` = the group, the KL reference on (``algo.kl_coef: 0.01``: a third copy of
the weights and one more scoring pass), training recipe ``blockwise``, fp32 on the CPU. The model is
random, so a response runs to ``max_new_tokens`` unless it samples a stop token (about 1 in
``vocab`` per token); the table prints the tokens the step really scored.

* ``chunked``   the library as it is: the token scorer (``infir2.loss.score_tokens``) chunks RL's
                scoring (old, reference and policy log-probabilities, the entropy) at 256 MiB of fp32
                logits (``loss.scorer.AUTO_CHUNK_BYTES``);
* ``unchunked`` the same step with the budget raised past the whole micro-batch, so every scoring pass
                takes the model's full ``[B, R, V]`` logits and their fp32 ``log_softmax`` (what RL did
                before it used the scorer); run only where ``--unchunked-max-gib`` allows
                (4 fp32 ``[B, R, V]`` blocks at most).

Columns: the step's peak RSS (``ru_maxrss``: Python, torch and the model included) and its rise over
the RSS before the run started; ``[B,R,V] fp32`` the bytes of ONE full-vocabulary fp32 block of the
micro-batch (the unchunked scoring holds several at once); the scoring and update time per scored
token (``rl.update.score`` + ``rl.update.update``, summed over their calls).

``--context N`` instead runs each case once in one process and once under ``torchrun --nproc_per_node N``
with ``parallel.context: N`` (every prompt + response split over the N processes for the scoring and
the update; ``rl/context.py``), and prints per process the peak RSS of the rollout (set-up included) and
the rise of RSS over the scoring and the update (their high-water mark, reset when scoring starts through
``/proc/self/clear_refs``, minus the RSS at that moment): the part context parallelism splits.

    OMP_NUM_THREADS=1 python benchmarks/rl_step_memory.py                      # 1k-8k x 32k, 152k
    OMP_NUM_THREADS=1 python benchmarks/rl_step_memory.py --lengths 4096 --vocabs 151936
    OMP_NUM_THREADS=1 python benchmarks/rl_step_memory.py --context 2 --lengths 4096 --vocabs 32000 \
        --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infir2.tools.machine import cpu_description

GIB = 2**30
FP32_BYTES = 4
#: the unchunked scoring's full-vocabulary blocks held at once, for --unchunked-max-gib's estimate
#: (the logits, their fp32 log_softmax, the entropy's exp and product)
UNCHUNKED_BLOCKS = 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def vm_hwm() -> int:
    """This process's peak RSS since start or the last ``reset_hwm`` (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_hwm() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: ``5`` written to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(
    vocab: int,
    length: int,
    batch: int,
    hidden: int,
    unchunked: bool,
    layers: int = 1,
    context: int = 1,
    shared: str | None = None,
) -> dict:
    """One RL step; ``shared``: the run's parent folder, which the processes of a torchrun launch share
    (it holds ``prompts.jsonl``); None: a temporary one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny builders
    import torch

    import infir2.loss.scorer as scorer
    from conftest import make_tiny_model, make_tokenizer
    from infir2.rl import loop as rl_loop
    from infir2.rl import rl
    from rl_runs import one_step_config

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if unchunked:
        scorer.AUTO_CHUNK_BYTES = 1 << 62  # every micro-batch "fits": the model's whole logits
    timed = {"score": 0.0, "update": 0.0, "tokens": 0}
    phases: dict[str, int] = {}
    real_score, real_update = rl_loop.score, rl_loop.update

    def score(run, rl_batch, plan):  # type: ignore[no-untyped-def]
        if not phases:  # the rollout (and the set-up) are done: the training phase's own peak from here
            phases["rollout_peak"] = vm_hwm()
            reset_hwm()
            phases["train_start"] = rss_bytes()
        t = time.perf_counter()
        out = real_score(run, rl_batch, plan)
        timed["score"] += time.perf_counter() - t
        timed["tokens"] += int(rl_batch.response_len.sum())
        return out

    def update(*args):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real_update(*args)
        timed["update"] += time.perf_counter() - t
        phases["train_peak"] = vm_hwm()
        return out

    rl_loop.score, rl_loop.update = score, update  # type: ignore[assignment]
    tok = make_tokenizer()
    before = rss_bytes()
    with tempfile.TemporaryDirectory() as temporary:
        out = shared or temporary
        prompts = Path(out) / "prompts.jsonl"
        if shared is None:
            write_prompts(prompts)
        cfg = one_step_config(
            out,
            prompts,
            "step",
            batch,
            length,
            kl_coef=0.01,
            parallel={"context": context},
            model={"beyond_context": True},
        )
        model = make_tiny_model(vocab_size=vocab, hidden=hidden, layers=layers, max_positions=length + 64)
        t0 = time.perf_counter()
        rl(cfg, model=model, tokenizer=tok, progress=False)
        wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": peak, "before": before, "wall": wall, **timed, **phases}


def write_prompts(path: Path) -> None:
    path.write_text(json.dumps({"problem": "Compute 7 + 5.", "answer": "12"}) + "\n")


def run_child(spec: list, nproc: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run([*launch, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)


def context_cases(args: argparse.Namespace) -> None:
    """Each case in one process, then on ``args.context`` processes at ``parallel.context`` = that many."""
    import torch

    n = args.context
    print(
        f"# {cpu_description()}; torch {torch.__version__}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(
        f"# {args.layers}-layer Qwen2, hidden {args.hidden}, {args.batch} responses, FP8 rollouts, KL reference on"
    )
    print(f"{'vocab':>7} {'max_new':>7} {'scored':>7} {'layout':>12} {'rollout peak':>12} {'train rise':>10}")
    for vocab in map(int, args.vocabs.split(",")):
        for length in map(int, args.lengths.split(",")):
            spec = [vocab, length, args.batch, args.hidden, False, args.layers]
            proc = run_child([*spec, 1, None])
            if proc.returncode != 0:
                print(
                    f"{vocab:>7} {length:>7} one process failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}"
                )
                continue
            one = json.loads(proc.stdout.strip().splitlines()[-1])
            with tempfile.TemporaryDirectory() as shared:
                write_prompts(Path(shared) / "prompts.jsonl")
                proc = run_child([*spec, n, shared], nproc=n)
                ranks = [json.loads(p.read_text()) for p in sorted(Path(shared).glob("rank*.json"))]
            if proc.returncode != 0 or len(ranks) != n:
                print(
                    f"{vocab:>7} {length:>7} context {n} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}"
                )
                continue
            rows = [("one process", one)] + [(f"context {n}, r{r}", x) for r, x in enumerate(ranks)]
            for layout, r in rows:
                rise = r["train_peak"] - r["train_start"]
                print(
                    f"{vocab:>7} {length:>7} {r['tokens']:>7} {layout:>12} {r['rollout_peak'] / GIB:>11.2f}G "
                    f"{rise / GIB:>9.2f}G",
                    flush=True,
                )
            worst = max(r["train_peak"] - r["train_start"] for r in ranks)
            print(
                f"{'':>29} train rise, worst rank / one process: {worst / (one['train_peak'] - one['train_start']):.2f}x"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="max_new_tokens per case")
    p.add_argument("--vocabs", default="32000,151936")
    p.add_argument("--batch", type=int, default=2, help="responses per step (= the micro-batch)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--unchunked-max-gib", type=float, default=6.0, help="skip unchunked runs above this")
    p.add_argument("--context", type=int, default=1, help="N > 1: one process vs N processes at context N")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = json.dumps(child(*spec))
        if len(spec) > 7 and spec[7]:  # a torchrun launch: each process writes its own file
            (Path(spec[7]) / f"rank{os.environ.get('RANK', '0')}.json").write_text(result)
        print(result)
        return
    if args.context > 1:
        context_cases(args)
        return
    import torch

    print(
        f"# {cpu_description()}; torch {torch.__version__}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"# 1-layer Qwen2, hidden {args.hidden}, {args.batch} responses, FP8 rollouts, KL reference on")
    head = f"{'vocab':>7} {'max_new':>7} {'scored':>7} {'mode':>9} {'peak RSS':>9} {'rise':>8}"
    print(f"{head} {'[B,R,V] fp32':>12} {'us/token':>9} {'step s':>7}")
    for vocab in map(int, args.vocabs.split(",")):
        for length in map(int, args.lengths.split(",")):
            block = args.batch * length * vocab * FP32_BYTES
            modes = ["chunked"]
            if UNCHUNKED_BLOCKS * block <= args.unchunked_max_gib * GIB:
                modes.append("unchunked")
            times = {}
            for mode in modes:
                spec = json.dumps([vocab, length, args.batch, args.hidden, mode == "unchunked"])
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", spec], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    print(f"{vocab:>7} {length:>7} {'':>7} {mode:>9} failed (rc {proc.returncode}):")
                    print(proc.stderr[-2000:])
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                per_token = (r["score"] + r["update"]) / max(r["tokens"], 1) * 1e6
                times[mode] = per_token
                print(
                    f"{vocab:>7} {length:>7} {r['tokens']:>7} {mode:>9} {r['peak'] / GIB:>7.2f}G "
                    f"{(r['peak'] - r['before']) / GIB:>7.2f}G {block / GIB:>11.2f}G {per_token:>9.1f} "
                    f"{r['wall']:>7.1f}",
                    flush=True,
                )
            if len(times) == 2:
                print(
                    f"{'':>33} chunked / unchunked time per token: {times['chunked'] / times['unchunked']:.2f}x"
                )


if __name__ == "__main__":
    main()
