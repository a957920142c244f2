"""One variant of `infir2 demo --rl`'s study: which start, split and learning rate make RL learn?

    python benchmarks/rl_study_sweep.py --out /tmp/sweep/s3 --set start_epochs=3 --set start_lr=1e-3 \\
        --set split=two-op --set lr=1e-4 --set seeds=0,1 --set pairs=high:bf16 --start-only
    python benchmarks/rl_study_sweep.py --out /tmp/sweep/s3 --set start_epochs=3 --set start_lr=1e-3 \\
        --set split=two-op --set lr=1e-4 --set seeds=0,1 --set pairs=high:bf16

``--set KEY=VALUE`` overrides a field of ``infir2.tools.demo.rl.STUDY`` (tuples comma-separated),
``--demo-set KEY=VALUE`` one of the demo's ``DemoSettings`` (its data, CPT and SFT: e.g. ``n_cpt_tables``). The
start is the study's (``start_model``: the demo's CPT, then an SFT of ``start_epochs`` at ``start_lr``),
trained in ``--out`` or reused from it. ``--start-only`` prints the start's accuracy on the study's
held-out problems, greedy and at the rollout temperature (8 samples: avg@8 and pass@8): the headroom
RL has; with ``--sharpen 1.1,1.5`` also avg@8 with the logits scaled by each factor (the final norm's
weights): how much of that headroom a sharper distribution alone would take. Without it, the study runs
(``--jobs`` runs at a time) and each run prints its held-out accuracy (greedy, or avg@k with ``--set
eval_samples=k``) at every evaluation and its rollout reward in means of 5 steps, then the verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from pathlib import Path

from demo_seeds import parse_sets  # benchmarks/demo_seeds.py

from infir2.tools.demo.results import FULL, DemoSettings
from infir2.tools.demo.rl import STUDY, RLStudy, _problems, run_rl_study, start_model
from infir2.tools.demo.rl_results import accuracy_name
from infir2.tools.machine import machine_description


def start_headroom(out: Path, study: RLStudy, s: DemoSettings, sharpen: tuple[float, ...] = ()) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infir2.eval import evaluate, load_problems

    hf = start_model(out, s, study)
    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    problems = load_problems(_problems(out, s, study)[1], "math")  # the study's held-out problems
    common = dict(max_new_tokens=s.max_new_tokens, batch_size=200, progress=False)
    greedy = evaluate(model, tokenizer, problems, greedy=True, **common).summary

    def avg8() -> dict:
        return evaluate(
            model, tokenizer, problems, n=8, temperature=study.temperature, top_p=1.0, **common
        ).summary

    sampled = avg8()
    print(f"start {hf}: {len(problems)} held-out problems ({study.split} split)")
    print(
        f"  greedy {100 * greedy['avg@n']:.1f}%  avg@8 {100 * sampled['avg@n']:.1f}%  pass@8 {100 * sampled['pass@8']:.1f}%"
    )
    norm = model.model.norm.weight  # the final RMSNorm: its scale is the logits' (the head is linear)
    original = norm.detach().clone()
    print(f"  final norm weights: mean |w| {float(original.abs().mean()):.3f}")
    for scale in sharpen:  # a logit-scale move alone: how much of the headroom is sharpening
        with torch.no_grad():
            norm.copy_(original * scale)
        print(f"  final norm x {scale:g} (logits x {scale:g}): avg@8 {100 * avg8()['avg@n']:.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a field of the study")
    p.add_argument(
        "--demo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a DemoSettings field (data, CPT, SFT)",
    )
    p.add_argument("--start-only", action="store_true", help="only the start's headroom")
    p.add_argument(
        "--sharpen",
        default="",
        metavar="S1,S2",
        help="--start-only: also avg@8 with the final norm's weights (so the logits) scaled by each S",
    )
    p.add_argument("--jobs", type=int, default=2, help="RL runs at a time")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    study = parse_sets(args.set, STUDY)
    settings = parse_sets(args.demo_set, FULL)
    print(machine_description())
    print(f"study: {dataclasses.asdict(study)}")
    if args.start_only:
        start_headroom(args.out, study, settings, tuple(float(x) for x in args.sharpen.split(",") if x))
        return
    record = run_rl_study(args.out, False, study, args.jobs, settings)
    name = accuracy_name(record["study"])
    for run in record["runs"]:
        val = " ".join(f"{step}:{100 * acc:.0f}" for step, acc in run["val"])
        r = run["reward"]
        means = " ".join(f"{statistics.mean(r[i : i + 5]):.2f}" for i in range(0, len(r), 5))
        print(f"{run['pair']} s{run['seed']}: held-out {name} % by step {val} | reward per 5 steps {means}")


if __name__ == "__main__":
    main()
