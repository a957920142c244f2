"""The CLI's logging under torchrun: INFO from rank 0 only, warnings and errors from every rank with
its number (``infir2._logging.setup_logging``, read from torchrun's RANK / WORLD_SIZE by ``cli.main``)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from conftest import make_tiny_model
from infir2.cli import main


@contextlib.contextmanager
def bare_root_logger():
    """The root logger without pytest's handlers (``basicConfig`` only configures a bare root)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hf")
    make_tiny_model(hidden=64, layers=1).save_pretrained(src)
    return src


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2)])
def test_info_on_rank_0_only_warnings_from_every_rank(
    tiny_folder: Path, tmp_path: Path, monkeypatch, capsys, rank: int, world: int
) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "fp8"
    # the conversion logs an INFO line ("converted ..."); a WARNING of a library logger is made here
    with bare_root_logger():
        assert main(["export", "--model", str(tiny_folder), "--out", str(out)]) == 0
        logging.getLogger("infir2.export.convert").warning("a deprecated thing, for the test")
    lines = [line for line in capsys.readouterr().err.splitlines() if "infir2." in line]
    infos = [line for line in lines if " INFO " in line and "converted" in line]
    warnings = [line for line in lines if " WARNING " in line and "deprecated" in line]
    assert len(warnings) == 1 and len(infos) == (1 if rank == 0 else 0), lines
    tag = f"[rank {rank}]"
    assert all((tag in line) == (world > 1) for line in infos + warnings), lines
