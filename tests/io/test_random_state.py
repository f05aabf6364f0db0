"""A rank's random state: only its own CUDA generator, so a resume may see fewer GPUs than the save."""

from __future__ import annotations

from unittest import mock

import torch

from lightning_tp3d.io.random_state import capture_rng_state, restore_rng_state


def test_only_the_current_cuda_device_generator_is_saved_and_restored():
    saved_state = torch.ByteTensor([1, 2, 3])
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_initialized", return_value=True), \
            mock.patch("torch.cuda.current_device", return_value=3), \
            mock.patch("torch.cuda.get_rng_state", return_value=saved_state) as get_state, \
            mock.patch("torch.cuda.get_rng_state_all") as get_all, \
            mock.patch("torch.cuda.set_rng_state") as set_state, \
            mock.patch("torch.cuda.set_rng_state_all") as set_all:
        state = capture_rng_state()
        restore_rng_state(state)
    get_state.assert_called_once_with(3)
    set_state.assert_called_once_with(saved_state, 3)
    get_all.assert_not_called()
    set_all.assert_not_called()
    assert torch.equal(state["cuda"], saved_state)


def test_cpu_and_python_states_round_trip():
    state = capture_rng_state()
    expected = torch.rand(3)
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
