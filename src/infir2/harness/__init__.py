"""The run harness under every stage (``infir2 train``, ``infir2 rl``): what a run is, apart from its step.

* ``config`` -- the shared sections (run, model, fp8, optim, parallel, the keys of every ``train``) with
  one set of rules, and the one YAML reader (``--set`` overrides); ``typed_yaml`` types them;
* ``run`` -- the process group, the locked run folder (``lock``), the shared command-line arguments;
  ``config_changes`` -- resuming with a changed config (each stage lists what is meaningful, one
  ``run.accept_config_changes``);
* ``setup`` -- the model and tokenizer, made trainable, with a hook before FSDP2 sharding
  (``distributed``);
* ``optim`` -- AdamW (parameter groups, low-precision moments) and the schedules;
* ``metrics`` -- metrics.jsonl, TensorBoard, the progress bar;
* ``resume`` -- checkpoints (every RNG, the stage's counters and named data state) through
  ``checkpoint/``, restore, and the final Hugging Face export;
* ``guards`` -- the gradient norm, skipped-step streaks, the spike rule;
* ``step`` -- the update step's shared parts: the loss scale, the seeded rounding noise of a
  micro-batch (NVFP4), the tail (clip, one optimizer step when finite, gradients freed).

A stage (``train/``, ``rl/``) is its config sections, its data or rollouts, its step and its loop; the
rest is here, once.
"""

from .config import Fp8Config, ModelConfig, OptimConfig, RunSection
from .distributed import DistEnv, init_distributed, shard_model
from .guards import NonFiniteError, SpikeRule, StepGuard, clip_grad_norm
from .metrics import MetricsLogger, peak_memory_gib
from .optim import build_optimizer
from .resume import LoadRequest, SavePolicy, export_final, restore, save
from .run import open_run
from .setup import check_model_inputs, load_run_tokenizer, setup_model

__all__ = [
    "DistEnv",
    "Fp8Config",
    "LoadRequest",
    "MetricsLogger",
    "ModelConfig",
    "NonFiniteError",
    "OptimConfig",
    "RunSection",
    "SavePolicy",
    "SpikeRule",
    "StepGuard",
    "build_optimizer",
    "check_model_inputs",
    "clip_grad_norm",
    "export_final",
    "init_distributed",
    "load_run_tokenizer",
    "open_run",
    "peak_memory_gib",
    "restore",
    "save",
    "setup_model",
    "shard_model",
]
