"""The built-in engine: KV-cache generation in this process (``sampler.sample_batch``).

``precision`` (one of ``base.PRECISIONS``) names what the seven decoder projections run in while generating:

* ``high``   -- as the model's high-precision parts (an ``Fp8Linear`` runs as a plain linear);
* ``fp8``    -- the FP8 export as deployed: ``ServingFp8Linear`` (128x128 weights from
  ``export.layout.quantize_weight``, 1x128 activations, ``scale_encoding`` pow2 or fp32);
* ``recipe`` -- the model's own ``Fp8Linear`` layers in FP8 (a model converted with a training recipe:
  ``infir2 eval --precision recipe --recipe NAME``, ``evaluate(precision="recipe")``).

``copy_model``: generate from a copy that ``load_weights(policy)`` refreshes (RL: gathered whole from an
FSDP2-sharded policy, one tensor at a time in the same order on every rank), else from the model itself
(evaluation; ``fp8`` then swaps its projections in place). ``base_dtype`` (``fp8`` with
``copy_model``): the copy holds every other tensor -- embeddings, norms, ``lm_head``, biases -- rounded to
it, as the FP8 export stores them (``infir2 export --base-dtype``, bf16 by default), so the copy's
weights are the export folder's values (the arithmetic stays in ``model_precision``); None keeps the
policy's own values. ``exact``: decode with exact numerics (``nn.exact``: each token's logits the bits
of one full forward of a model switched by ``nn.exact.use_exact_numerics``, as RL's trainer is under
``rollout.exact``); the engine switches its own model. Samples are batched ``batch_size`` at a
time in the order asked, each from a generator seeded with its own seed. ``record_routes`` (RL's routing
replay): each sample carries the experts every MoE layer chose for its tokens (``Sample.routes``,
``sample_routes``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..nn import fp8_enabled, fp8_modules
from ..nn.exact import use_exact_numerics
from ..nn.moe.routing import NO_ROUTE, record_routes
from .base import PRECISIONS, Prompt, Request, Sample, SamplingConfig, check_prompt_fits, stops_and_pad
from .fp8_linear import ServingFp8Linear, serve_fp8
from .sampler import sample_batch

__all__ = ["BuiltinEngine", "apply_precision", "precision_label", "sample_routes"]

log = logging.getLogger(__name__)


def precision_label(precision: str, scale_encoding: str = "pow2", recipes: Sequence[str] = ()) -> str:
    """What ``BuiltinEngine.label`` says (the settings a resumed evaluation must match) for
    ``precision`` (``base.PRECISIONS``), the export's scales and the recipes of the model's ``Fp8Linear`` layers."""
    names = ", ".join(sorted(set(recipes)))
    return {
        "high": "high (fp8 disabled)",
        "fp8": f"fp8 (the export's weights, {scale_encoding} scales)",
        "recipe": f"recipe ({names})" if names else "recipe",
    }[precision]


def apply_precision(
    model: nn.Module, precision: str, recipe: str | None, scale_encoding: str = "pow2"
) -> None:
    """Make ``model`` compute in ``precision`` (``base.PRECISIONS``), in place: ``recipe`` converts its
    projections to ``Fp8Linear`` with the training recipe ``recipe`` (run in FP8 while generating);
    ``fp8`` swaps them for the FP8 export's ``ServingFp8Linear``; ``high`` leaves the model as it is. The
    one place both precisions are applied (the builtin engine's factory, eval's held-out loss)."""
    if precision == "recipe" and recipe is not None:
        from ..nn import convert_to_fp8

        convert_to_fp8(model, recipe)  # an unknown recipe name is a ValueError naming the choices
    elif precision == "fp8":
        serve_fp8(model, scale_encoding)


class BuiltinEngine:
    """In-process generation with a KV cache (see the module doc)."""

    returns_ids = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        precision: str = "high",
        scale_encoding: str = "pow2",
        model_precision: str | None = None,
        copy_model: bool = False,
        base_dtype: torch.dtype | None = None,
        record_routes: bool = False,
        name: str = "builtin",
        exact: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.name, self.model_precision, self.copy_model = name, model_precision, copy_model
        self.record_routes = record_routes
        self.stop_ids, self.pad_id = stops_and_pad(tokenizer)
        self.precision = precision  # the word (base.PRECISIONS); ``label`` says it for eval's settings
        self.base_dtype = base_dtype if precision == "fp8" else None
        self.label = precision_label(
            precision, scale_encoding, [m.recipe.name for _, m in fp8_modules(model)]
        )
        self.model = copy.deepcopy(model).eval().requires_grad_(False) if copy_model else model
        self.fp8_layers: dict[str, ServingFp8Linear] = {}
        if copy_model or precision == "fp8":
            self.fp8_layers = serve_fp8(self.model, scale_encoding if precision == "fp8" else None)
        self.exact, self._warned_threads = exact, False
        if exact:  # after the swaps above: the served experts modules are row-padded too
            use_exact_numerics(self.model)
        if hasattr(self.model.config, "use_cache"):
            self.model.config.use_cache = True
        if copy_model:
            self.load_weights(model)

    @property
    def served_dtype(self) -> str:
        """The dtype the high-precision parts compute in (eval's summary, RL's ``rollout_dtype``): bf16
        autocast, else the model's own (float32 on a CPU, or fp64 reference runs)."""
        if self.model_precision == "bf16":
            return "bfloat16"
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        return str(dtype).removeprefix("torch.")

    @torch.no_grad()
    def load_weights(self, policy: nn.Module) -> None:
        """Copy the policy's weights (gathered whole if FSDP2 shards them; every rank calls this), the FP8
        projections quantized by the export's function, the other tensors rounded to ``base_dtype``."""
        own = dict(self.model.named_parameters())
        for name, p in policy.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a DTensor shard under FSDP2
            fqn, _, kind = name.rpartition(".")
            if fqn in self.fp8_layers:
                self.fp8_layers[fqn].load_tensor(kind, full.detach())
            elif self.base_dtype is not None:  # the export's cast (round to nearest), held in own dtype
                own[name].copy_(full.detach().to(self.base_dtype))
            else:
                own[name].copy_(full.detach())

    def quantized_weights(self) -> dict[str, torch.Tensor]:
        """The FP8 projection tensors as the export names them (``<fqn>.weight``, ``<fqn>.weight_scale_inv``)."""
        out = {}
        for fqn, layer in self.fp8_layers.items():
            out[f"{fqn}.weight"] = layer.weight
            out[f"{fqn}.weight_scale_inv"] = layer.weight_scale_inv
        return out

    def forward_context(self) -> AbstractContextManager[Any]:
        """Around a forward of ``self.model``: its FP8 recipe layers on or off as ``precision`` says (what
        ``generate`` computes in; RL's ``rollout.rescore`` scores in it too)."""
        return (
            fp8_enabled(self.model, self.precision == "recipe") if self.precision != "fp8" else nullcontext()
        )

    def generate(self, request: Request) -> list[list[Sample]]:
        prompts, sampling = request.prompts, request.sampling
        if self.exact and torch.get_num_threads() > 1 and not self._warned_threads:
            self._warned_threads = True  # multi-threaded GEMMs may split a batch's rows by thread
            log.warning("exact numerics are measured at one intra-op thread; %d run", torch.get_num_threads())
        _check_prompt_lengths(self.model, prompts, sampling)
        flat = [(i, j, p.ids, seed) for i, p in enumerate(prompts) for j, seed in enumerate(p.seeds)]
        out: list[list[Sample]] = [[] for _ in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                self.forward_context(),
                tqdm(total=len(flat), desc=self.name, unit="seq", disable=not request.progress) as bar,
            ):
                for start in range(0, len(flat), sampling.batch_size):
                    chunk = flat[start : start + sampling.batch_size]
                    device = next(self.model.parameters()).device
                    gens = [torch.Generator(device=device).manual_seed(s) for *_, s in chunk]
                    ids_of = [ids for _, _, ids, _ in chunk]
                    recording = record_routes(self.model, len(chunk)) if self.record_routes else nullcontext()
                    with recording as routes:
                        samples = sample_batch(
                            self.model,
                            ids_of,
                            gens,
                            sampling,
                            self.stop_ids,
                            self.pad_id,
                            self.model_precision,
                            self.exact,
                        )
                    if routes is not None:
                        sample_routes(routes.routes(), ids_of, samples)
                    for (i, j, _, _), s in zip(chunk, samples, strict=True):
                        out[i].append(s)
                        request.done(i, j, s)
                    bar.update(len(chunk))
        finally:
            self.model.train(was_training)
        return out


def sample_routes(
    routes: torch.Tensor | None, prompts: Sequence[list[int]], samples: Sequence[Sample]
) -> None:
    """Set each sample's ``routes`` from a left-padded batch's ``[B, columns, layers, k]`` (``RouteLog``):
    its prompt's columns, then one per response token fed to a decode step -- all but the last, which
    no forward is fed (``NO_ROUTE``); None for a dense model."""
    if routes is None:
        return
    width, longest = max(len(p) for p in prompts), max(len(s.response_ids) for s in samples)
    if routes.shape[1] not in (width + longest - 1, width + longest):  # the last step may feed one more
        raise RuntimeError(
            f"routing replay: the sampler's forwards fed {routes.shape[1]} columns for prompts {width} wide "
            f"and responses up to {longest} tokens: not one column per token fed, the routes cannot be placed"
        )
    for i, (prompt, s) in enumerate(zip(prompts, samples, strict=True)):
        start, n = width - len(prompt), len(prompt) + len(s.response_ids)
        own = torch.full((n, *routes.shape[2:]), NO_ROUTE, dtype=routes.dtype)
        fed = routes[i, start : start + n - 1]
        own[: fed.shape[0]] = fed
        s.routes = own


def _check_prompt_lengths(model: nn.Module, prompts: Sequence[Prompt], sampling: SamplingConfig) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    check_prompt_fits(max((len(p.ids) for p in prompts), default=0), limit, sampling.beyond_context)
