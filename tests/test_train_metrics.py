"""The progress bar shows the step it counts: its loss is the one just logged, not the previous step's."""

from __future__ import annotations

from infir2.harness.metrics import MetricsLogger


def test_progress_bar_shows_the_current_steps_loss(tmp_path, capsys):
    with MetricsLogger(tmp_path, enabled=True, start_step=0, total_steps=3, progress=True) as logger:
        logger._bar.mininterval = 0  # redraw on every update, as a slow step would
        for step, loss in [(1, 5.25), (2, 4.5), (3, 3.75)]:
            logger.log({"step": step, "loss": loss})
            screen = capsys.readouterr().err.split("\r")[-1]
            assert f"{step}/3" in screen and f"loss={loss:.4f}" in screen, screen
