"""`parallel/nf4.py` on one process: what a layout can hold of a quantised base, refused before anything is
split (the torchao NF4 base itself trains in `tests/models/test_qlora.py`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_tp3d.parallel.nf4 import check_quantized_base, dequantized, is_quantized, to_nf4
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.qlora import NF4Format

SMALL_BLOCKS = NF4Format(block_size=32, scaler_block_size=8)


def test_a_bitsandbytes_base_is_refused_at_every_layout_with_the_torchao_path_named():
    bnb = pytest.importorskip("bitsandbytes")
    dense = nn.Linear(64, 128, bias=False)
    layer = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4")
    network = nn.Sequential(layer.to("cpu"), nn.Linear(128, 8))
    assert torch.isfinite(network(torch.randn(2, 64))).all()  # a working 4-bit model on this CPU
    for layout in (ParallelLayout(), ParallelLayout(pipeline_parallel_size=2, num_microbatches=2)):
        with pytest.raises(ValueError, match=r"0.weight is a bitsandbytes Params4bit.*quantize_base\(model\)"):
            check_quantized_base(network, layout, sharded_over_dp=False)


def test_an_nf4_base_is_refused_where_the_layout_cannot_hold_it():
    pytest.importorskip("torchao")
    network = nn.Sequential(nn.Linear(32, 16, bias=False))
    network[0].weight = nn.Parameter(to_nf4(network[0].weight.detach(), SMALL_BLOCKS), requires_grad=False)
    assert is_quantized(network[0].weight) and dequantized(network[0].weight).shape == (16, 32)
    check_quantized_base(network, ParallelLayout(data_parallel_size=2), sharded_over_dp=True)  # 8 rows, 256 weights
    with pytest.raises(LayoutError, match="tensor parallelism cannot split a 4-bit NF4 weight"):
        check_quantized_base(network, ParallelLayout(tensor_parallel_size=2), sharded_over_dp=False)
    with pytest.raises(LayoutError, match=r"0.weight \(16 x 32, NF4\) cannot be sharded by FSDP over dp=4"):
        check_quantized_base(network, ParallelLayout(data_parallel_size=4), sharded_over_dp=True)
    check_quantized_base(network, ParallelLayout(data_parallel_size=4), sharded_over_dp=False)  # replicate
