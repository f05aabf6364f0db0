"""Lightning as it is: every case of `tests.strategies.conformance` under TP3DStrategy, on every rank,
against plain Lightning on one process running the same module, data and seed (or refused before the
first training step, with its message).

One 4-process world runs every case at each of its layouts; the one-process runs happen here. Records
are compared entry by entry: integers, strings, names and decisions exactly, losses, scores, learning
rates and norms within rtol 1e-5 (fp32 parity: the layouts sum in another order, ~1e-7 relative per
step, over a few steps), weights after AdamW steps as `assert_adam_weights_close` derives, predictions
(logits) within rtol 1e-5 + atol 1e-5.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import released_process_groups, start_distributed
from tests.helpers import assert_adam_weights_close, world_size
from tests.strategies.conformance import CASES, LAYOUTS, WORLD, docs_table, run_case

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL, ATOL = 1e-5, 1e-6
DOCS = Path(__file__).resolve().parents[2] / "docs" / "lightning.md"
# Entries that are not observations of the feature: wall time, which rank wrote the record.
IGNORED = {"seconds", "rank"}


def run_world(directory: str) -> dict[tuple[str, str], dict[str, Any]]:
    assert world_size() == WORLD
    run_released = released_process_groups()(run_case)
    return {(name, layout): run_released(name, layout, Path(directory) / name / layout)
            for name, case in CASES.items() for layout in case.layouts}


_references: dict[tuple[str, int], dict[str, Any] | Exception] = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[tuple[str, str], dict[str, Any]]]:
    """Every rank's records; the one-process references are run while the world runs (on the cores its
    ranks leave idle while they wait for each other)."""
    running = start_distributed(WORLD, "tests.strategies.test_conformance:run_world",
                                str(tmp_path_factory.mktemp("conformance")), timeout=1800)
    try:
        for name, layout in CASE_LAYOUTS:
            if layout not in CASES[name].refused:
                # a case whose one-process run fails fails its own tests: `reference` raises it there again
                with contextlib.suppress(Exception):
                    reference(name, LAYOUTS[layout][0][2], _reference_directory(tmp_path_factory))
    finally:
        records = running.result()
    return records


def _reference_directory(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "conformance-one-process"


def reference(name: str, dp: int, directory: Path) -> dict[str, Any]:
    """The case on one process (emulating dp rank 0's view for cases with replica semantics)."""
    key = (name, dp if CASES[name].replica_semantics else 1)
    if key not in _references:
        try:
            _references[key] = run_case(name, None, directory / f"{name}-{key[1]}", key[1])
        except Exception as error:  # noqa: BLE001 - kept, and raised by every test of the case
            _references[key] = error
    if isinstance(_references[key], Exception):
        raise _references[key]
    return _references[key]


def assert_same(found: Any, expected: Any, where: str = "") -> None:
    """`found` equals `expected` as described in the module docstring."""
    if isinstance(expected, dict):
        assert isinstance(found, dict), where
        keys = set(expected) - IGNORED
        assert set(found) - IGNORED == keys, f"{where}: keys {sorted(set(found) - IGNORED)} != {sorted(keys)}"
        for key in sorted(keys, key=str):
            assert_same(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(found, (list, tuple)) and len(found) == len(expected), f"{where}: {found} != {expected}"
        for index, (a, b) in enumerate(zip(found, expected)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(found, expected, rtol=RTOL, atol=1e-5, msg=lambda message: f"{where}: {message}")
    elif isinstance(expected, float) and not isinstance(found, bool):
        assert isinstance(found, (int, float)), f"{where}: {found!r}"
        assert math.isclose(found, expected, rel_tol=RTOL, abs_tol=ATOL) or found == expected, \
            f"{where}: {found!r} != {expected!r}"
    else:
        assert found == expected, f"{where}: {found!r} != {expected!r}"


def _rows_of_rank(batches: list[torch.Tensor], rank: int, dp: int) -> list[torch.Tensor]:
    """What dp rank `rank` holds of each one-process batch: its rows rank, rank + dp, ..."""
    return [batch[rank::dp] for batch in batches]


CASE_LAYOUTS = [(name, layout) for name, case in CASES.items() for layout in case.layouts]


@pytest.mark.parametrize(("name", "layout"), CASE_LAYOUTS, ids=[f"{name}-{layout}" for name, layout in CASE_LAYOUTS])
def test_feature_behaves_as_on_one_process(world, tmp_path_factory, name, layout):
    case = CASES[name]
    (tp, pp, dp), _ = LAYOUTS[layout]
    records = [ranks[(name, layout)] for ranks in world]
    if layout in case.refused:
        for rank, record in enumerate(records):
            assert record["error"] is not None and re.search(case.refused[layout], record["error"]), (rank, record)
            assert record["training_steps"] == 0, f"rank {rank}: refused after {record['training_steps']} steps"
        return
    expected = reference(name, dp, _reference_directory(tmp_path_factory))
    assert "exception" not in expected, expected
    for rank, record in enumerate(records):
        assert "exception" not in record, f"rank {rank}: {record['exception']}"
        coordinates = (rank // (tp * dp), rank // tp % dp)  # (pp, dp) of this rank
        CHECKS.get(name, _same)(record, expected, rank, dp, coordinates, f"{name}@{layout} rank {rank}")


def _same(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    assert_same(record, expected, where)


def _rank_zero_only(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int],
                    where: str) -> None:
    """What only global rank 0 does (prints the summary, writes the logs, a user's one-process read)."""
    if rank == 0:
        _same(record, expected, rank, dp, coordinates, where)


def _summary(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    if rank == 0:
        assert record["summary"]["total"] == expected["summary"]["total"] > 0, where
        _same(record, expected, rank, dp, coordinates, where)
    else:
        assert record["summary"] is None, where


def _gathered(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    """DDP's semantics: [dp, b, s], entry r the batch of dp rank r = rows r, r + dp, ... of one process's
    batch (which one process's `all_gather` returns as it is)."""
    assert len(record["gathered"]) == len(expected["gathered"]) > 0, where
    for found, batch in zip(record["gathered"], expected["gathered"]):
        torch.testing.assert_close(found, torch.stack([batch[r::dp] for r in range(dp)]), rtol=0, atol=0)


def _evaluation(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    """Predictions on every rank: each dp rank's own samples (rows dp_rank, dp_rank + dp, ...)."""
    dp_rank = coordinates[1]
    for key in ("predictions", "fresh_predictions"):
        assert_same(record[key], _rows_of_rank(expected[key], dp_rank, dp), f"{where}.{key}")
    _same({k: v for k, v in record.items() if "predictions" not in k},
          {k: v for k, v in expected.items() if "predictions" not in k}, rank, dp, coordinates, where)


def _weights(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    if rank == 0:
        assert record["hparams"] == expected["hparams"], where
        for weights in ("weights", "last_weights"):  # a step's checkpoint, and `save_last`'s last.ckpt
            assert record[weights].keys() == expected[weights].keys(), where
            for key, value in expected[weights].items():
                assert_adam_weights_close(record[weights][key], value, f"{where} {weights} {key}")


def _max_time(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    """Stopped by time, as on one process: the decision is rank 0's, broadcast, so the step is the world's;
    every step's loss is the one-process run's (which runs longer: `conformance.max_time`)."""
    assert 2.0 <= record["seconds"] < 60 and record["global_step"] < 2000, (where, record["seconds"])
    assert len(record["losses"]) <= len(expected["losses"]), (where, len(record["losses"]), len(expected["losses"]))
    assert_same(record["losses"], expected["losses"][:len(record["losses"])], where)


def _device_stats(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    assert record["keys"] == expected["keys"] and len(record["keys"]) > 0, where
    assert_same(record["losses"], expected["losses"], where)


def _votes(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int], where: str) -> None:
    """One rank of 4 voting True (or False): "all" is False (True only when all agree), "any" True."""
    answers = {key: value for key, value in record.items() if key not in IGNORED}
    assert answers == {"one_true_all": False, "one_true_any": True, "one_false_all": False, "one_false_any": True}, \
        (where, answers)


def _fabric_collectives(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int],
                        where: str) -> None:
    """Values over the dp replicas (each counted once), decisions over all ranks, rank 0's broadcast."""
    assert record["all_reduce"] == pytest.approx(sum(range(1, dp + 1)) / dp, rel=1e-6), where
    assert record["all_gather"] == list(range(dp)), where
    assert record["broadcast"] == {"from": 0}, where
    assert record["votes"] == [False, True, False, True], where


def _filtered_load(record: dict, expected: dict, rank: int, dp: int, coordinates: tuple[int, int],
                   where: str) -> None:
    """Each rank holds its stage's parameters: they are one process's after the same filtered load; a
    filter on the optimizer is refused (plain Fabric saves the kept entries)."""
    assert record["step"] == expected["step"] == 1, where
    assert expected["optimizer_filter"] is None
    assert "names an optimizer" in record["optimizer_filter"], where
    loaded = record["loaded"]
    assert loaded.keys() <= expected["loaded"].keys(), where
    kept = [name for name in loaded if "norm" in name or "lm_head" in name]
    assert kept and len(kept) < len(loaded), (where, "a stage holds saved and unsaved parameters")
    for name, value in loaded.items():
        assert torch.equal(value, record["trained"][name]) == (name in kept), (where, name, "saved iff kept")
        assert_adam_weights_close(value, expected["loaded"][name], f"{where} {name}")
        assert_adam_weights_close(record["trained"][name], expected["trained"][name], f"{where} {name}")


CHECKS = {
    "model_summary": _summary, "rich_model_summary": _summary, "model_summary_flops": _summary,
    "loggers": _rank_zero_only, "all_gather": _gathered, "evaluation_loops": _evaluation,
    "load_from_checkpoint": _weights, "max_time": _max_time, "device_stats_monitor": _device_stats,
    "reduce_boolean_decision": _votes, "fabric_collectives": _fabric_collectives,
    "fabric_save_load_filter": _filtered_load,
}


def test_max_time_stops_every_rank_at_the_same_step(world):
    for layout in CASES["max_time"].layouts:
        steps = {ranks[("max_time", layout)]["global_step"] for ranks in world}
        assert len(steps) == 1, (layout, steps)


def test_docs_table_is_the_conformance_matrix():
    """docs/lightning.md holds `python -m tests.strategies.conformance`'s table, so the two cannot drift;
    every refusal says why."""
    assert docs_table() in DOCS.read_text()
    assert all(case.note for case in CASES.values() if case.refused)
