"""Every `python` and `bash` block of docs/*.md runs.

The blocks of one page run in order, each in its own process, in a fresh working folder holding links
to `examples/` and `benchmarks/`; files a block writes are there for the next (so a page can train a model, export it,
then check it). `tp3d ...` commands run as `python -m lightning_tp3d.cli ...`. Blocks that need GPUs,
a cluster or a server are written as `console` blocks, which are shown but not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parent.parent
PAGES = sorted((REPOSITORY / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return _BLOCK.findall(page.read_text())


def test_pages_have_runnable_code():
    assert {page.name for page in PAGES if _blocks(page)} >= {
        "quickstart.md", "concepts.md", "plugging_in.md", "checkpoints.md", "export_and_serving.md",
        "precision_and_recompute.md", "doctor_and_serving_plan.md", "launching.md", "fabric.md", "communication.md"}


@pytest.mark.parametrize("page", [page for page in PAGES if _blocks(page)], ids=lambda page: page.name)
def test_page_code_runs(page, tmp_path):
    for folder in ("examples", "benchmarks"):
        (tmp_path / folder).symlink_to(REPOSITORY / folder)
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    for index, (language, code) in enumerate(_blocks(page)):
        if language == "python":
            script = tmp_path / f"block_{index}.py"
            script.write_text(code)
            command = [sys.executable, str(script)]
        else:
            code = re.sub(r"^tp3d ", f"{sys.executable} -m lightning_tp3d.cli ", code, flags=re.MULTILINE)
            command = ["bash", "-euo", "pipefail", "-c", code]
        process = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900)
        assert process.returncode == 0, f"{page.name} block {index} ({language}):\n{code}\n{process.stderr[-3000:]}"
