"""Rollout engines: generate ``n`` responses per prompt with per-token log-probabilities, and take new weights.

The trainer talks to an engine through ``RolloutEngine`` only (two methods), so a serving engine on
GPUs (vLLM, SGLang) plugs in without changing the loop (docs/RL.md, "Plugging in a serving engine"):

* ``load_weights(policy)`` -- called after every optimizer update of a rollout batch: take the current
  master weights (a serving engine would receive the FP8 export of them: ``export.layout.quantize_weight``
  per projection, the DeepSeek-V3 layout both engines load). Under torchrun every rank calls it: an
  FSDP2-sharded policy's weights are all-gathered (``DTensor.full_tensor``), one at a time, in the same
  order on every rank, so each rank's engine holds the whole model;
* ``generate(prompts, n, seed, greedy)`` -- for each prompt (token ids), ``n`` sampled continuations as
  ``Rollout`` (response ids including the stop token, the engine's log-probability of each, whether it
  stopped before ``max_new_tokens``). The policy is ``softmax(logits / temperature)``, no top-p / top-k,
  so the trainer's log-probabilities of the same tokens can be compared with the engine's. ``seed`` is
  one seed per prompt (an int: ``derive_seeds(seed, len(prompts))``), and prompt i's samples depend on
  its seed only, not on the other prompts of the call or on how the engine batches them (their random
  draws do not; the batched forward may change a log-probability at float rounding): a run split over
  ranks generates the groups one process would (vLLM: a request per prompt, ``SamplingParams(n=n,
  seed=seed_i)``).

``BuiltinEngine`` runs in the training process: a copy of the policy that generates with a KV cache
(``transformers.DynamicCache``), prompts left-padded in batches. ``precision`` names the seven
projections' GEMMs while generating:

* ``bf16`` -- the projections as the training run computes its high-precision parts (``model.precision``);
* ``fp8``  -- each projection weight is quantized 128x128 blockwise *by the export's own function*
  (``infir2.export.layout.quantize_weight``; the codes and ``scale_inv`` are bit-identical to what
  ``infir2 export --format fp8`` writes for the same weights), and each activation 1x128 per token at
  run time (``activation_scheme: dynamic``), as a serving engine runs an FP8 checkpoint. ``scale``:
  pow2 (the export's default, and the ``blockwise`` training recipe's) or fp32 (``blockwise_fp32scale``).

With ``fp8`` rollouts and ``blockwise`` training (or ``bf16`` with ``bf16``) the engine and the trainer
quantize identically; the only differences left are those of incremental (KV-cache) decoding.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..export.layout import WEIGHT_BLOCK, export_scale_encoding, is_projection_weight, quantize_weight
from ..fp8.recipe import TILE, Cast, get_recipe
from ..kernels import Operand, bind
from ..model import autocast

__all__ = ["BuiltinEngine", "Rollout", "RolloutEngine", "ServingFp8Linear", "derive_seeds", "left_pad"]

#: the training recipe that quantizes exactly as the fp8 rollout of each scale encoding
SAME_RECIPE = {"pow2": "blockwise", "fp32": "blockwise_fp32scale"}


@dataclass
class Rollout:
    """One sampled response: ids (the stop token included when it stopped), log-probabilities, finished."""

    response_ids: list[int]
    logprobs: list[float]
    finished: bool  # stopped at a stop token (False: cut at max_new_tokens)


def derive_seeds(seed: int, k: int) -> list[int]:
    """``k`` seeds drawn from ``seed`` (a seeded ``torch.Generator``): the per-prompt and per-sample seeds."""
    return torch.randint(0, 2**62, (k,), generator=torch.Generator().manual_seed(seed)).tolist()


class RolloutEngine(Protocol):
    def load_weights(self, policy: nn.Module) -> None: ...

    def generate(
        self, prompts: Sequence[list[int]], n: int, seed: int | Sequence[int], greedy: bool = False
    ) -> list[list[Rollout]]:
        """``n`` rollouts per prompt (``result[i][j]``: prompt i, sample j), reproducible for a prompt's seed."""
        ...


class ServingFp8Linear(nn.Module):
    """A projection as an FP8 serving engine runs it: stored 128x128-block weights, 1x128 activations.

    ``y = Q(x, 1x128) @ (weight * weight_scale_inv).T + b``, with ``weight`` ``float8_e4m3fn [N, K]``
    and ``weight_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]`` exactly as in the FP8 export; the GEMM
    runs on the same kernel chain as training (``infir2.kernels.bind``), fp32 accumulation.
    """

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scale: str, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scale = in_features, out_features, scale
        rows, cols = -(-out_features // WEIGHT_BLOCK[0]), -(-in_features // WEIGHT_BLOCK[1])
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale_inv", torch.ones(rows, cols, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.act_cast = Cast(TILE, "e4m3", "pow2" if scale == "pow2" else "fp32")
        self.kernels = bind(get_recipe(SAME_RECIPE[scale]), device)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a master weight with the export's function (``quantize_weight``) into the buffers."""
        self.load_tensor("weight", weight)
        if bias is not None:
            self.load_tensor("bias", bias)

    @torch.no_grad()
    def load_tensor(self, kind: str, tensor: torch.Tensor) -> None:
        """``kind`` ``weight`` (quantized as ``load`` does) or ``bias`` (copied)."""
        if kind == "weight":
            data, scale_inv = quantize_weight(tensor.detach(), export_scale_encoding(self.scale))
            self.weight.copy_(data)
            self.weight_scale_inv.copy_(scale_inv)
        elif kind == "bias" and self.bias is not None:
            self.bias.copy_(tensor.detach())
        else:
            raise ValueError(f"ServingFp8Linear has no parameter {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # [..., K] -> [T, K]
        with torch.autocast(x.device.type, enabled=False):
            xq = self.kernels.quantize(x2d, self.act_cast)
            w = Operand(self.weight, self.weight_scale_inv, WEIGHT_BLOCK)
            out_dtype = x.dtype if self.bias is None else torch.float32
            y = self.kernels.gemm_nt(xq, w, out_dtype)  # [T,K] @ [K,N] -> [T,N], fp32 accumulate
            if self.bias is not None:
                y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)


def left_pad(
    seqs: Sequence[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, W]`` ids and attention mask, each sequence right-aligned (W = the longest)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


class BuiltinEngine:
    """In-process generation with a KV cache from a copy of the policy (see the module doc)."""

    def __init__(
        self,
        policy: nn.Module,
        precision: str,
        scale: str,
        model_precision: str,
        temperature: float,
        max_new_tokens: int,
        batch_size: int,
        stop_ids: Sequence[int],
        pad_id: int,
    ) -> None:
        if not stop_ids:
            raise ValueError(
                "the tokenizer has neither <|im_end|> nor an eos token: generation could never stop"
            )
        self.precision, self.model_precision = precision, model_precision
        self.temperature, self.max_new_tokens, self.batch_size = temperature, max_new_tokens, batch_size
        self.stop_ids, self.pad_id = sorted(set(stop_ids)), pad_id
        self.device = next(policy.parameters()).device
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.fp8_layers: dict[str, ServingFp8Linear] = {}
        for fqn, module in list(self.model.named_modules()):
            # the layers whose weights the FP8 export quantizes (the same key pattern, by construction)
            if not isinstance(module, nn.Linear) or not is_projection_weight(f"{fqn}.weight", module.weight):
                continue
            if hasattr(module, "fp8_enabled"):
                setattr(module, "fp8_enabled", False)  # noqa: B010 - an Fp8Linear copy runs as a plain linear
            if precision == "fp8":
                layer = ServingFp8Linear(
                    module.in_features, module.out_features, module.bias is not None, scale, self.device
                )
                parent, _, child = fqn.rpartition(".")
                setattr(self.model.get_submodule(parent), child, layer)
                self.fp8_layers[fqn] = layer
        if hasattr(self.model.config, "use_cache"):
            self.model.config.use_cache = True
        self.load_weights(policy)

    @torch.no_grad()
    def load_weights(self, policy: nn.Module) -> None:
        """Copy the policy's weights (gathered whole if FSDP2 shards them; every rank calls this), the FP8
        projections quantized by the export's function."""
        own = dict(self.model.named_parameters())
        for name, p in policy.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a DTensor shard under FSDP2
            fqn, _, kind = name.rpartition(".")
            if fqn in self.fp8_layers:
                self.fp8_layers[fqn].load_tensor(kind, full.detach())
            else:
                own[name].copy_(full.detach())

    def quantized_weights(self) -> dict[str, torch.Tensor]:
        """The FP8 projection tensors as the export names them (``<fqn>.weight``, ``<fqn>.weight_scale_inv``)."""
        out = {}
        for fqn, layer in self.fp8_layers.items():
            out[f"{fqn}.weight"] = layer.weight
            out[f"{fqn}.weight_scale_inv"] = layer.weight_scale_inv
        return out

    def generate(
        self, prompts: Sequence[list[int]], n: int, seed: int | Sequence[int], greedy: bool = False
    ) -> list[list[Rollout]]:
        seeds = derive_seeds(seed, len(prompts)) if isinstance(seed, int) else list(seed)
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        # one generator per sample, seeded from its prompt's seed: a sample does not depend on its batch
        flat = [
            (p, s)
            for p, prompt_seed in zip(prompts, seeds, strict=True)
            for s in derive_seeds(prompt_seed, n)
        ]
        out: list[Rollout] = []
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            gens = [torch.Generator(device=self.device).manual_seed(s) for _, s in chunk]
            out += self._generate_batch([p for p, _ in chunk], gens, greedy)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(
        self, prompts: Sequence[list[int]], gens: Sequence[torch.Generator], greedy: bool
    ) -> list[Rollout]:
        from transformers import DynamicCache

        ids, mask = left_pad(prompts, self.pad_id, self.device)
        b = ids.shape[0]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        stops = torch.tensor(self.stop_ids, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        with autocast(self.model_precision, self.device):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            next_pos = positions[:, -1:] + 1
            for _ in range(self.max_new_tokens):
                logprobs = F.log_softmax(out.logits[:, -1].float() / self.temperature, dim=-1)
                if greedy:
                    tok = logprobs.argmax(-1)
                else:
                    probs = logprobs.exp()  # each row from its own generator (one draw per row and token)
                    tok = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
                lp = logprobs.gather(1, tok[:, None]).squeeze(1)
                tokens.append(torch.where(done, self.pad_id, tok))
                logps.append(lp)
                done = done | torch.isin(tok, stops)
                if bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=next_pos,
                    cache=cache,
                    use_cache=True,
                )
                next_pos = next_pos + 1
        return [
            self._rollout(torch.stack(tokens, 1)[i].tolist(), torch.stack(logps, 1)[i].tolist())
            for i in range(b)
        ]

    def _rollout(self, ids: list[int], logps: list[float]) -> Rollout:
        stop_at = next((j for j, t in enumerate(ids) if t in self.stop_ids), None)
        keep = len(ids) if stop_at is None else stop_at + 1
        return Rollout(ids[:keep], logps[:keep], finished=stop_at is not None)
