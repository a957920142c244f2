"""Chunk size of the LM-head loss against its speed and memory: `train.loss_chunk_tokens: auto` picks it.

The chunked loss (``infir2.loss.scorer``) makes one ``[chunk, V]`` fp32 logits block at a time, so its
memory falls with the chunk while the number of GEMM launches grows. Each chunk size runs in its own
subprocess (one high-water mark cannot hide another): summed CE + backward of ``hidden [T,H] @
lm_head [V,H].T``, ``--repeats`` times after one warm-up; the table gives the best time, the RSS high-
water mark above the point where the inputs exist, and both as ratios to the first chunk size (by
default 2048, the chunk the earlier auto rule used at this shape).

    python benchmarks/logits_chunk_budget.py                      # T=4096 V=151936 H=256, fp32
    python benchmarks/logits_chunk_budget.py --tokens 8192 --chunks 2048,441 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from logits_memory import child_json  # the same one-process-per-measurement runner

GIB = 2**30


def child(tokens: int, vocab: int, hidden: int, chunk: int, repeats: int) -> dict:
    import torch

    from infir2.loss import linear_cross_entropy_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = torch.randn(vocab, hidden).mul_(hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    setup_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        h.grad = w.grad = None
        t0 = time.perf_counter()
        linear_cross_entropy_sum(h, w, labels, -100, chunk).backward()
        times.append(time.perf_counter() - t0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "chunk": chunk,
        "seconds": min(times[1:]),
        "above_setup_gib": (peak_kib - setup_kib) / 2**20,
        "chunk_logits_gib": min(chunk, tokens) * vocab * 4 / GIB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--chunks", default="2048,882,441,110", help="chunk sizes (tokens); the first is the reference"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed runs per chunk size after one warm-up")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens, args.vocab, args.hidden, args.child, args.repeats)))
        return
    from infir2.loss import chunk_tokens_for

    rows = []
    for chunk in map(int, args.chunks.split(",")):
        flags = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "repeats": args.repeats}
        rows.append(child_json(__file__, f"chunk {chunk}", str(chunk), **flags))
    print(
        f"T={args.tokens} V={args.vocab} H={args.hidden} fp32; chunked CE + backward, best of {args.repeats}; "
        f"auto picks chunk {chunk_tokens_for('auto', args.tokens, args.vocab)}"
    )
    print(
        f"{'chunk':>6}{'chunk logits GiB':>18}{'seconds':>9}{'time/ref':>10}{'RSS above setup GiB':>21}"
        f"{'mem/ref':>9}"
    )
    ref = rows[0]
    for r in rows:
        print(
            f"{r['chunk']:>6}{r['chunk_logits_gib']:>18.3f}{r['seconds']:>9.2f}{r['seconds'] / ref['seconds']:>10.3f}"
            f"{r['above_setup_gib']:>21.2f}{r['above_setup_gib'] / ref['above_setup_gib']:>9.3f}"
        )


if __name__ == "__main__":
    main()
