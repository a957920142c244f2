"""A small deterministic StepSource for the training tests (no tokenizer, no files).

Each sequence is an arithmetic progression ``x_t = (a + b t) mod V`` with ``a``, ``b`` drawn per
sequence from a generator seeded by (seed, step): learnable in a few steps, and any step can be
regenerated from its index, which makes the position in the data (``{"step": k}``) the whole state.
The first ``0..seq_len/2`` labels of each row are ``IGNORE_INDEX`` (like a prompt), so the number of
loss tokens differs between micro-batches and ranks -- which exercises the global per-token mean.
The global batch is split across ranks in contiguous blocks of rows, then into micro-batches, so
one process sees exactly the micro-batches that N processes see together (same FP8 tiles).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from infir2.data.base import IGNORE_INDEX, MicroBatch


class SyntheticSource:
    def __init__(
        self,
        vocab_size: int = 300,
        seq_len: int = 32,
        global_batch_size: int = 8,  # rows a step, all ranks together
        micro_batch_size: int = 2,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        steps: int | None = None,  # None: endless
    ) -> None:
        assert global_batch_size % (world_size * micro_batch_size) == 0
        self.vocab_size, self.seq_len, self.global_batch_size = vocab_size, seq_len, global_batch_size
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.seed, self.steps, self.step = seed, steps, 0

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n, length = self.global_batch_size, self.seq_len
        a = torch.randint(0, self.vocab_size, (n, 1), generator=g)
        b = torch.randint(1, 4, (n, 1), generator=g)
        ids = (a + b * torch.arange(length)) % self.vocab_size
        labels = ids.clone()
        prompt = torch.randint(0, length // 2, (n,), generator=g)
        labels[torch.arange(length) < prompt[:, None]] = IGNORE_INDEX
        return ids, labels

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("endless source")
        return self.steps

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while self.steps is None or self.step < self.steps:
            ids, labels = self.global_batch(self.step)
            self.step += 1
            per_rank = self.global_batch_size // self.world_size
            rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
            ids, labels = ids[rows], labels[rows]
            m = self.micro_batch_size
            yield [{"input_ids": ids[i : i + m], "labels": labels[i : i + m]} for i in range(0, len(ids), m)]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class DiesAfter:
    """A source that calls ``die()`` (the end of a killed process) when asked for step ``after`` + 1: the
    first base of a step source whose ``step`` counts the steps handed out (``CrashAfter`` below)."""

    step: int

    def __init__(self, after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.after = after

    def die(self) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        for step in super().__iter__():  # type: ignore[misc]  # the step source's, the next base
            if self.step > self.after:
                self.die()
            yield step


class CrashAfter(DiesAfter, SyntheticSource):
    """Dies (like a killed process: a ``KeyboardInterrupt``) when asked for step ``after`` + 1."""

    def die(self) -> None:
        raise KeyboardInterrupt("simulated kill")


def subprocess_env(tests_too: bool = True) -> dict[str, str]:
    """The environment of a child process (torchrun, ``python -c``) that imports infir2 from this
    checkout and, with ``tests_too``, these helpers; one intra-op thread."""
    import os
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    paths = [str(tests.parent / "src"), *([str(tests)] if tests_too else [])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


#: a child process that trains and SIGKILLs itself when asked for step 4 (after step 3's checkpoint)
_KILLED_RUN = """
import json, os, signal, sys
from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import SyntheticSource, tiny_run_config

class KillAfter(SyntheticSource):
    def __iter__(self):
        for step in super().__iter__():
            if self.step > 3:
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, no finally
            yield step

cfg = tiny_run_config(sys.argv[1], "split", **json.loads(sys.argv[2]))
train(cfg, model=make_tiny_model(), train_source=KillAfter(seed=1), progress=False)
"""


def killed_and_resumed(tmp_path: Any, sections: dict[str, Any]) -> tuple[Any, Any]:
    """A 6-step tiny run of ``sections`` (``save_every: 3``) SIGKILLed in a child process after step 3's
    checkpoint and resumed here, and the same run uninterrupted: ``(resumed, full)``, ``train``'s results."""
    import json
    import subprocess
    import sys

    from conftest import make_tiny_model
    from infir2.train import train

    kw = {**sections, "train": {"max_steps": 6, "save_every": 3, "keep_last": 2, **sections.get("train", {})}}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(tmp_path), json.dumps(kw)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    cfg = tiny_run_config(tmp_path, "split", **kw)
    resumed = train(cfg, model=make_tiny_model(seed=7), train_source=SyntheticSource(seed=1), progress=False)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step_00000003"
    full = train(
        tiny_run_config(tmp_path, "full", **kw),
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1),
        progress=False,
    )
    return resumed, full


def torchrun(*args: object, nproc: int = 2, timeout: int = 300, env: dict[str, str] | None = None) -> Any:
    """Launch ``args`` (a script and its arguments, or ``"-m", module, ...``) under ``torchrun --standalone``
    on ``nproc`` CPU processes with ``subprocess_env()``; assert it exits 0 (showing the output's tails)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        cmd + [str(a) for a in args],
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def end_process_group(rank: int) -> None:
    """End a torchrun worker's gloo group (``infir2``'s ``destroy_process_group``) and assert that its
    threads ended with it: a group FSDP2 used and a cache kept alive ran on into interpreter exit, where
    it aborted the process now and then (``infir2._dist.release_mesh_caches``)."""
    from pathlib import Path

    from infir2.harness.distributed import destroy_process_group

    destroy_process_group()
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.exists() else []
    left = [n for n in names if "gloo" in n]
    assert not left, f"rank {rank}: the process group's threads outlived destroy_process_group: {left}"


def tiny_run_config(out_dir: str, name: str = "run", **sections: dict[str, Any]):
    """A RunConfig for the tiny models: fp32 high precision on CPU, a short WSD schedule."""
    from infir2.train.config import parse_config

    data: dict[str, dict[str, Any]] = {
        "run": {"name": name, "out_dir": str(out_dir), "device": "cpu", "seed": 0},
        "model": {"precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "optim": {"lr": 3e-3},
        "schedule": {"name": "wsd", "warmup_fraction": 0.2, "decay_fraction": 0.3, "min_lr_ratio": 0.1},
        "train": {"max_steps": 6},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return parse_config(data, "<test>")


def checkpoint_state(step: int, numel: int = 4096) -> dict[str, Any]:
    """A state with the trainer's checkpoint keys: ``numel`` random model floats (seeded by ``step``), an
    empty optimizer, the data position and a train state with an RNG entry (tuples, like Python's)."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(numel, generator=g)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"step": step},
        "data": [{"epoch": 0, "step_in_epoch": step}],
        "train_state": {"step": step, "world_size": 1, "rng": [{"python": (3, (1, 2), None)}]},
    }


def tiny_llama(layers: int = 2, max_positions: int = 256) -> dict[str, Any]:
    """``model.from_config`` of the command-line tests' tiny Llama: hidden 64, MLP 128, 4 heads, 2 KV heads."""
    return {
        "arch": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
    }


def prepared_cpt(folder: Any, documents: int = 100) -> tuple[Any, Any]:
    """``folder/tokenizer`` (the tests' tiny BPE) and ``folder/cpt`` (``prepare-cpt`` of ``documents`` short
    arithmetic lines): the two folders a command-line CPT test names."""
    import json
    from pathlib import Path

    from conftest import make_tokenizer
    from infir2.data import load_tokenizer, prepare_cpt

    folder = Path(folder)
    make_tokenizer().save_pretrained(folder / "tokenizer")
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"{i} + {i} = {2 * i}."}) + "\n" for i in range(documents)))
    tokenizer = load_tokenizer(folder / "tokenizer")
    prepare_cpt([docs], folder / "cpt", tokenizer, val_fraction=0.1, progress=False)
    return folder / "tokenizer", folder / "cpt"


def cpt_data(path: Any, seq_len: int, global_batch_size: int, micro_batch_size: int) -> dict[str, Any]:
    """A run config's ``data`` section that reads the ``prepare-cpt`` folder ``path``."""
    return {
        "kind": "cpt",
        "train_path": str(path),
        "seq_len": seq_len,
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
    }


def one_thread():
    """Generator for an autouse fixture: one intra-op thread (on a shared 2-core CPU, OpenMP's
    two threads spin against other processes and tiny GEMMs get ~50x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def regression_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """One optimizer step per ``step`` of an MSE regression on random data seeded by the step (the same
    batches for every model and optimizer of a test): 8 rows as wide as the first linear's input,
    targets as wide as the last linear's output."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, linears[0].in_features, generator=g)
        y = torch.randn(8, linears[-1].out_features, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def tiny_cpt_sections(folder: Any) -> dict[str, Any]:
    """A one-step bf16 CPT config of a 1-layer tiny Llama on 200 documents prepared in ``folder`` (runs
    under ``folder/runs``): the bad-input tests' training config."""
    tok, data = prepared_cpt(folder, documents=200)
    return {
        "run": {"name": "t", "out_dir": str(folder / "runs"), "device": "cpu"},
        "model": {"from_config": tiny_llama(layers=1, max_positions=64), "tokenizer": str(tok)},
        "fp8": {"recipe": "bf16"},
        "data": {"train_path": str(data), "seq_len": 16, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }


def tiny_rl_sections(folder: Any, model_dir: Any) -> dict[str, Any]:
    """A one-step RL config of ``model_dir`` on four problems written to ``folder/p.jsonl`` (runs under
    ``folder/runs``): the bad-input tests' RL config."""
    import json

    prompts = folder / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"problem": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    return {
        "run": {"name": "rl", "out_dir": str(folder / "runs"), "device": "cpu"},
        "model": {"path": str(model_dir), "precision": "fp32"},
        "data": {"prompts_path": str(prompts)},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "oversample_prompts": 2, "max_new_tokens": 4},
        "train": {"max_steps": 1},
    }
