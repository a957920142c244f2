"""``rollout.rescore``: the rollout log-probabilities from the trainer's scorer run on the engine's weights.

The built-in engine samples with a KV cache: each new token's logits come from a one-row decode step over
the cache, the trainer's from one full forward of the padded rows. The two reduce in different orders, so
even for the identical pairs (an engine that computes what the trainer computes) a few tokens differ in
their last bits (docs/RL.md, "Identical pairs"). With ``rollout.rescore: true`` the log-probabilities the
sampler reported are replaced, before the step is scored, by ``update.response_logprobs`` -- the trainer's
scorer, on the same micro-batches -- run on the engine's own model, in the precision it generates in
(``BuiltinEngine.forward_context``). The ratios are then those of the engine's weights against the
trainer's in the same forward: exactly 1 for the identical pairs; the FP8 rounding of the other pairs
stays. The tokens were still drawn from the sampler's distribution: rescoring changes what the ratios are
measured against, not what was sampled.

The cost is one more forward of the batch on the engine's copy, no backward. Each rank rescores the rows it
scores; under context parallelism each rank of a data replica rescores them whole (the copy is not split).
"""

from __future__ import annotations

import time
from typing import cast

import torch

from ..generation import BuiltinEngine
from .batch import RLBatch
from .state import Run
from .update import Plan, my_micro_batches, response_logprobs

__all__ = ["rescore"]


@torch.no_grad()
def rescore(run: Run, batch: RLBatch, plan: Plan) -> float:
    """Overwrite ``batch.rollout_logp`` of this rank's rows of ``plan`` with the engine's weights' scores
    (the module doc); the seconds it took. Call it before the engine takes new weights."""
    t0 = time.perf_counter()
    engine = cast(BuiltinEngine, run.engine.engine)  # rollout.rescore is refused with any other engine
    cfg, data = run.cfg, run.context.data_env
    for mini in plan:
        for micro in my_micro_batches(mini, data.rank, data.world_size):
            if micro is None:  # no collectives in the copy's forward: nothing to pad
                continue
            rows = batch.rows(micro)
            with engine.forward_context():
                logp, _ = response_logprobs(engine.model, rows, cfg.rollout.temperature, cfg.model.precision)
            real = rows.response_mask.bool()
            batch.rollout_logp[rows.index, : logp.shape[1]] = logp.cpu().masked_fill(~real, 0)
    return time.perf_counter() - t0
