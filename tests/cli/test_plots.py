"""`tp3d plan --plot FILE.png` (`cli/plots.py`): the memory ledger (with the schedule's timeline under it when
pp > 1) and the advisor drawn, files written at the figure's size (10 x 5 inches at 100 dpi, 10 x 8 with the
timeline), non-empty."""

from __future__ import annotations

import pytest

from lightning_tp3d.cli import main
from lightning_tp3d.cli.plots import DPI, FIGURE_INCHES, TIMELINE_INCHES

image = pytest.importorskip("matplotlib.image")


def _drawn(path, inches: tuple[float, float] = FIGURE_INCHES) -> None:
    pixels = image.imread(path)
    assert pixels.shape[:2] == (int(inches[1] * DPI), int(inches[0] * DPI))  # rows, columns
    assert pixels[..., :3].std() > 0.05  # not a blank canvas: bars, points, text


def test_the_memory_ledger_is_drawn_per_stage_and_per_deploy_size(tmp_path, capsys):
    path = tmp_path / "plots" / "memory.png"
    assert main(["plan", "deepseek-llm-7b", "--tp", "2", "--dp", "4", "--plot", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().err
    _drawn(path)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_the_schedule_timeline_is_drawn_under_the_ledger(tmp_path, capsys, schedule):
    path = tmp_path / f"{schedule}.png"
    assert main(["plan", "deepseek-llm-7b", "--tp", "2", "--pp", "4", "--num-microbatches", "8",
                 "--schedule", schedule, "--plot", str(path)]) == 0
    _drawn(path, TIMELINE_INCHES)


def test_the_advisor_draws_every_layout_with_the_best_marked(tmp_path, capsys):
    path = tmp_path / "advisor.png"
    assert main(["plan", "deepseek-llm-7b", "--gpus", "16", "--global-batch-size", "64", "--plot", str(path),
                 "--json"]) == 0
    assert capsys.readouterr().out.startswith("[")  # the JSON stays alone on stdout
    _drawn(path)
