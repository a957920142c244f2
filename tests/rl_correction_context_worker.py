"""Run under ``torchrun --nproc_per_node 2`` by test_rl_correction_context.py: the sequence-level correction
of rows split over two context ranks against the same rows scored whole.

``OUT``: every rank scores four prompt + response rows (responses of 90 to 230 tokens after prompts of 8 to
20: the rows pad to 256 positions, two shards of 128, and three of them have response tokens on both
shards) twice with the tiny model -- split over the context group (``rl.context.row_shard`` +
``rl.update.response_logprobs``, what ``rl.update.score`` runs under ``parallel.context: 2``) and whole
(one process's scoring, on an unsplit copy). The rollout log-probabilities are the whole scores minus
per-token offsets whose row means are set: geometric-mean ratios 1.0, 1.05, 0.8 and 1.3. Writes
``OUT/rank<r>.pt``: both scores, the response columns this rank's shard scored, and for each
``algo.tis_level`` the weights (``correction_weights``, truncate at cap 1.5, band 0.1) and metrics
(``correction_metrics``) from the split scores and from the whole ones.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import make_tiny_model
from infir2.harness.distributed import context_layout, context_parallel, init_distributed
from infir2.rl.batch import RLBatch
from infir2.rl.context import row_shard
from infir2.rl.correction import TIS_LEVELS, correction_metrics, correction_weights
from infir2.rl.update import response_logprobs
from train_synthetic import end_process_group

PROMPTS = (8, 20, 12, 15)
RESPONSES = (230, 90, 200, 170)
GEO_MEANS = (1.0, 1.05, 0.8, 1.3)
CAP, BAND = 1.5, 0.1


def rows_and_offsets() -> tuple[RLBatch, torch.Tensor]:
    """The four rows (the same on every rank) and the offsets ``whole - rollout`` ``[4, R]``."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPTS]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in RESPONSES]
    batch = RLBatch.of_responses(prompts, responses, pad_id=0)
    offsets = torch.zeros(len(RESPONSES), max(RESPONSES), dtype=torch.float64)
    for i, (n, geo) in enumerate(zip(RESPONSES, GEO_MEANS, strict=True)):
        noise = torch.randn(n, generator=g, dtype=torch.float64) * 0.05
        offsets[i, :n] = noise - noise.mean() + torch.log(torch.tensor(geo, dtype=torch.float64))
    return batch, offsets


def main(out: Path) -> None:
    env = init_distributed("cpu")
    torch.set_num_threads(1)
    layout = context_layout(env, 2)
    whole_model = make_tiny_model(seed=1)
    split_model = context_parallel(copy.deepcopy(whole_model), layout)
    batch, offsets = rows_and_offsets()
    rows = batch.rows(list(range(len(batch))))
    mask = rows.response_mask.bool()
    with torch.no_grad():
        whole, _ = response_logprobs(whole_model, rows, 1.0, "fp32")
        with row_shard(rows, layout) as part:
            assert part is not None
            split, _ = response_logprobs(split_model, rows, 1.0, "fp32", shard=part)
            start, width = int(part.batch["context_start"]), part.batch["input_ids"].shape[1]
    whole, split = whole.masked_fill(~mask, 0), split.masked_fill(~mask, 0)
    roll = (whole.double() - offsets).float().masked_fill(~mask, 0)
    record: dict = {"whole": whole, "split": split, "columns": (start - (rows.prompt_width - 1), width)}
    for level in TIS_LEVELS:
        for name, old in (("split", split), ("whole", whole)):
            record[f"{level}/{name}/weights"] = correction_weights(
                old, roll, mask, "truncate", CAP, level, BAND
            )
            record[f"{level}/{name}/metrics"] = correction_metrics(old, roll, mask, CAP, level, BAND)
    torch.save(record, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group(dist.get_rank())  # after main: its models held the context group
