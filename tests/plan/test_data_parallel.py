"""The data-parallel chooser: every mode at every dp / pp / overlap setting, the shards the ledgers read."""

import itertools

import pytest

from lightning_tp3d.plan.data_parallel import DATA_PARALLEL_MODES, GradientReduction, choose_data_parallel


@pytest.mark.parametrize(("mode", "dp", "pp", "overlap"),
                         list(itertools.product(DATA_PARALLEL_MODES, (1, 4), (1, 2), (True, False))))
def test_every_mode_gets_one_reduction_and_its_shards(mode: str, dp: int, pp: int, overlap: bool) -> None:
    plan = choose_data_parallel(mode, dp, pp, overlap_gradient_reduction=overlap)
    if mode == "fsdp":
        expected = GradientReduction.FULLY_SHARDED
    elif dp == 1:
        expected = GradientReduction.NONE
    elif mode == "zero1":
        expected = GradientReduction.REDUCE_SCATTER
    else:  # the overlapped all-reduce needs the gradients complete when one backward ends: no pipeline
        expected = GradientReduction.OVERLAPPED_ALL_REDUCE if overlap and pp == 1 else GradientReduction.ALL_REDUCE
    assert plan.reduction is expected and plan.mode == mode and plan.data_parallel_size == dp
    assert plan.parameter_shards == (dp if mode == "fsdp" else 1)
    assert plan.optimizer_shards == (dp if mode in ("fsdp", "zero1") else 1)
    # FSDP2 reshards after forward by default without pipelining only; the other modes never gather
    assert plan.reshard_after_forward == (mode == "fsdp" and pp == 1)


def test_fsdp_resharding_as_asked_and_refused_where_the_weight_pass_comes_after_it() -> None:
    assert choose_data_parallel("fsdp", 4, 2, fsdp_reshard_after_forward=True).reshard_after_forward
    assert not choose_data_parallel("fsdp", 4, 1, fsdp_reshard_after_forward=False).reshard_after_forward
    with pytest.raises(ValueError, match="zbv_zero_bubble"):
        choose_data_parallel("fsdp", 4, 2, fsdp_reshard_after_forward=True, pipeline_schedule="zbv_zero_bubble")


def test_a_mode_no_option_accepts_is_refused_naming_the_modes() -> None:
    names = r"\['replicate', 'fsdp', 'zero1'\]"
    with pytest.raises(ValueError, match=rf"data_parallel_mode='fsdp-reshard' is not one of {names}"):
        choose_data_parallel("fsdp-reshard", 4)
