"""Every `python` and `bash` block of docs/*.md runs.

The blocks of one page run in order, in a fresh working folder holding links to `examples/` and
`benchmarks/`; files a block writes are there for the next (so a page can train a model, export it, then
check it). A `python` block runs as `python block.py` on as many ranks of a live world as its largest
`devices=N` asks for (one without), as torchrun would start it (`tests.commands`). A `bash` block of
`tp3d ...` lines alone runs each line as that command on the live ranks its `--config`'s `trainer.devices`
asks for (one without); any other `bash` block runs in bash, with `tp3d` as `python -m lightning_tp3d.cli`.
Blocks that need GPUs, a cluster or a server are written as `console` blocks, which are shown but not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.commands import command_on_world, script_on_world

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parent.parent
PAGES = sorted((REPOSITORY / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_DEVICES = re.compile(r"\bdevices=(\d+)")
# a line that is one `tp3d` command with no shell syntax but a trailing comment
_COMMAND = re.compile(r"^tp3d ([^|;&<>$`#]*?)\s*(#.*)?$")


def _blocks(page: Path) -> list[tuple[str, str]]:
    return _BLOCK.findall(page.read_text())


def _commands(code: str) -> list[list[str]] | None:
    """The `tp3d` arguments of each line when every line of a bash block is one plain command, else None."""
    lines = [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]
    matches = [_COMMAND.match(line) for line in lines]
    return [shlex.split(match.group(1)) for match in matches] if all(matches) else None


def _command_world(arguments: list[str], directory: Path) -> int:
    """How many ranks `tp3d arguments` runs on: its `--trainer.devices`, else its config's, else 1."""
    options = dict(zip(arguments, arguments[1:]))
    if "--trainer.devices" in options:
        return int(options["--trainer.devices"])
    if "--config" in options:
        return int(yaml.safe_load((directory / options["--config"]).read_text())["trainer"].get("devices", 1))
    return 1


def test_pages_have_runnable_code():
    assert {page.name for page in PAGES if _blocks(page)} >= {
        "quickstart.md", "concepts.md", "plugging_in.md", "checkpoints.md", "export_and_serving.md",
        "precision_and_recompute.md", "doctor_and_serving_plan.md", "launching.md", "fabric.md", "communication.md"}


@pytest.mark.parametrize("page", [page for page in PAGES if _blocks(page)], ids=lambda page: page.name)
def test_page_code_runs(page, tmp_path):
    for folder in ("examples", "benchmarks"):
        (tmp_path / folder).symlink_to(REPOSITORY / folder)
    for index, (language, code) in enumerate(_blocks(page)):
        try:
            _run_block(language, code, index, tmp_path)
        except (AssertionError, TimeoutError) as error:
            raise AssertionError(f"{page.name} block {index} ({language}):\n{code}\n{error}") from None


def _run_block(language: str, code: str, index: int, directory: Path) -> None:
    """Run one block in `directory`: a failure raises with what each failing rank or bash printed."""
    if language == "python":
        script = directory / f"block_{index}.py"
        script.write_text(code)
        script_on_world(max(map(int, _DEVICES.findall(code)), default=1), str(script), str(directory))
    elif (commands := _commands(code)) is not None:
        for arguments in commands:
            command_on_world(_command_world(arguments, directory), arguments, str(directory))
    else:
        environment = {**os.environ, "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
        code = re.sub(r"^tp3d ", f"{sys.executable} -m lightning_tp3d.cli ", code, flags=re.MULTILINE)
        process = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=directory, env=environment,
                                 capture_output=True, text=True, timeout=900)
        assert process.returncode == 0, process.stderr[-3000:]
