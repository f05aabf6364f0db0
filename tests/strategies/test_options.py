"""The options declared once (`strategies/options.py`): the docs' table, YAML / jsonargparse, the model parts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.models.adapter import ModelAdapter, llama_tp_plan
from lightning_tp3d.parallel.pipeline import PipelineStages
from lightning_tp3d.strategies.options import ParallelOptions, options_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_the_docs_table_is_the_declaration():
    table = re.search(r"<!-- options-table[^\n]*-->\n(.*)<!-- end options-table -->", PAGE.read_text(), re.DOTALL)
    assert table is not None and table.group(1) == options_table()


@pytest.mark.parametrize("strategy", [TP3DStrategy, TP3DFabricStrategy])
def test_jsonargparse_reads_every_option_with_its_type_and_help(strategy: type, capsys) -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(strategy, "strategy")
    namespace = parser.parse_args(["--strategy.tensor_parallel_size=2", "--strategy.data_parallel_mode=zero1",
                                   "--strategy.layers_per_stage=[1, 3]"])
    built = strategy(**vars(namespace.strategy))
    assert built.core.options.tensor_parallel_size == 2 and built.core.options.data_parallel_mode == "zero1"
    assert built.core.options.layers_per_stage == (1, 3)
    with pytest.raises(Exception, match="data_parallel_mode"):
        parser.parse_args(["--strategy.data_parallel_mode=ddp"])  # a Literal: refused while parsing
    parser.print_help()
    assert "processes that split every layer" in capsys.readouterr().out


def test_model_parts_come_from_the_adapter_unless_an_option_sets_them():
    class Blocks(ModelAdapter):
        pass

    network = object()
    options = ParallelOptions(model_adapter=Blocks(layers_attribute="blocks"))
    adapter = options.model_adapter_for(network)
    assert isinstance(adapter, Blocks) and adapter.layers_attribute == "blocks"
    assert adapter.first_modules == ("model.embed_tokens",) and set(adapter.tp_plan()) == set(llama_tp_plan())
    stages = PipelineStages()
    adapter = ParallelOptions(layers_attribute="layers", pipeline_last_modules=["norm"], tp_plan={},
                              pipeline_stages=stages).model_adapter_for(network)
    assert (adapter.layers_attribute, adapter.last_modules, adapter.tp_plan()) == ("layers", ("norm",), {})
    assert adapter.pipeline_stages() is stages and type(adapter) is ModelAdapter
    with pytest.raises(TypeError, match="model_adapter must be a lightning_tp3d.models.adapter.ModelAdapter"):
        ParallelOptions(model_adapter=PipelineStages())
