"""Peak process memory of the LM-head loss + backward: plain F.cross_entropy vs the chunked loss.

Each variant runs in its own subprocess (so one high-water mark cannot hide another) and reports
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after ``loss.backward()``, together with the RSS just
after the inputs (hidden ``[T,H]``, lm_head weight ``[V,H]``, labels) were made. The table prints each
variant's peak, its peak above that setup point, and chunked / plain ratios of both.

    python benchmarks/logits_memory.py                          # T=8192, V=151936, H=1536, fp32
    python benchmarks/logits_memory.py --tokens 2048 --chunks 256,1024

The plain path needs about 3 x T x V x 4 bytes (logits, log-softmax, their gradient: ~15 GB at the
defaults); ``--max-gib`` caps each child's address space so that an overrun fails only that child.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

GIB = 2**30


def child(variant: str, tokens: int, vocab: int, hidden: int, chunk: int, max_gib: float) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (int(max_gib * GIB), int(max_gib * GIB)))
    import torch
    import torch.nn.functional as F

    from infir2.loss import linear_cross_entropy_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = torch.randn(vocab, hidden).mul_(hidden**-0.5).requires_grad_()  # in place: no setup temporary
    labels = torch.randint(0, vocab, (tokens,))
    labels[: tokens // 10] = -100
    setup_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if variant == "plain":
        loss = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100, reduction="sum")
    else:
        loss = linear_cross_entropy_sum(h, w, labels, -100, chunk)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "variant": variant if variant == "plain" else f"chunked/{chunk}",
        "loss": loss.item(),
        "grad_w_norm": w.grad.norm().item(),
        "setup_gib": setup_kib / 2**20,
        "peak_gib": peak_kib / 2**20,
        "seconds": seconds,
    }


def child_json(script: str, label: str, child: str, **flags: object) -> dict:
    """Run ``python script --child CHILD --flag value ...`` in a fresh process (one high-water mark per
    process); the JSON object on its last stdout line. Exits with the child's stderr tail if it fails."""
    cmd = [sys.executable, script, "--child", child]
    for name, value in flags.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{label} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--chunks", default="256,1024", help="chunk sizes (tokens) of the chunked variants")
    p.add_argument("--max-gib", type=float, default=20.0, help="address-space cap per child")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        variant, chunk = args.child.split(":")
        print(json.dumps(child(variant, args.tokens, args.vocab, args.hidden, int(chunk), args.max_gib)))
        return
    runs = [("plain", 0)] + [("chunked", int(c)) for c in args.chunks.split(",")]
    rows = []
    for variant, chunk in runs:
        flags = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "max_gib": args.max_gib}
        rows.append(child_json(__file__, f"{variant}:{chunk}", f"{variant}:{chunk}", **flags))
    plain = rows[0]
    print(f"T={args.tokens} V={args.vocab} H={args.hidden} fp32 inputs; loss + backward; RSS high-water mark")
    head = f"{'variant':<14}{'peak GiB':>10}{'above setup':>13}{'peak/plain':>12}{'above/plain':>13}"
    print(head + f"{'seconds':>9}{'loss rel.diff':>15}{'|dW| rel.diff':>15}")
    for r in rows:
        above = r["peak_gib"] - r["setup_gib"]
        plain_above = plain["peak_gib"] - plain["setup_gib"]
        print(
            f"{r['variant']:<14}{r['peak_gib']:>10.2f}{above:>13.2f}{r['peak_gib'] / plain['peak_gib']:>12.3f}"
            f"{above / plain_above:>13.3f}{r['seconds']:>9.1f}"
            f"{abs(r['loss'] / plain['loss'] - 1):>15.1e}{abs(r['grad_w_norm'] / plain['grad_w_norm'] - 1):>15.1e}"
        )


if __name__ == "__main__":
    main()
