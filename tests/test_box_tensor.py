"""`BoxTensor` (asyncwt._vllm.slices): a checkpoint tensor's full-shape stand-in
holding only the slice a tensor-parallel rank received. vLLM's loaders narrow it to
the rank's part; anything else must fail loudly, never load wrong bytes."""

from __future__ import annotations

import pytest
import torch

from asyncwt._vllm.slices import BoxTensor, SlicedLoading


def full() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def test_a_narrow_inside_the_box_is_a_view_of_the_received_bytes() -> None:
    box = full()[4:8].clone()  # rank 1 of 2: rows 4..8
    stand = BoxTensor.make(box, (4, 0), (8, 6))
    assert isinstance(stand, BoxTensor) and tuple(stand.shape) == (8, 6)
    part = stand.narrow(0, 4, 4)  # what a column-parallel loader asks of rank 1
    assert not isinstance(part, BoxTensor)
    assert torch.equal(part, full()[4:8])
    assert part.data_ptr() == box.data_ptr()  # no copy
    param = torch.zeros(4, 6)
    param.copy_(part)
    assert torch.equal(param, full()[4:8])
    assert torch.equal(stand.narrow(0, 5, 2).narrow(1, 1, 3), full()[5:7, 1:4])


def test_a_narrow_containing_the_box_keeps_standing_in_and_the_whole_box_is_itself() -> None:
    box = full()[2:4].clone()
    stand = BoxTensor.make(box, (2, 0), (8, 6))
    wider = stand.narrow(0, 0, 4)  # e.g. a fused tensor split first, then the rank's rows
    assert isinstance(wider, BoxTensor) and tuple(wider.shape) == (4, 6)
    assert torch.equal(wider.narrow(0, 2, 2), full()[2:4])
    whole = full()
    assert BoxTensor.make(whole, (0, 0), (8, 6)) is whole


def test_anything_but_narrowing_to_the_box_fails_naming_what_was_asked() -> None:
    stand = BoxTensor.make(full()[4:8].clone(), (4, 0), (8, 6))
    with pytest.raises(ValueError, match=r"narrowed dim 0 to \[2, 6\) .* received only \[4, 8\)"):
        stand.narrow(0, 2, 4)
    with pytest.raises(ValueError, match=r"copied the whole \(8, 6\) checkpoint tensor"):
        torch.zeros(8, 6).copy_(stand)
    with pytest.raises(NotImplementedError, match="outside the slice this rank received"):
        stand + 1


def test_sliced_loading_wraps_only_the_boxes_that_are_not_whole() -> None:
    loading = SlicedLoading()
    loading.declare(
        {"w": ((4, 0), (4, 6)), "norm": ((0,), (6,)), "gone": ((0,), (1,))},
        {"w": (8, 6), "norm": (6,)},
    )
    assert set(loading.boxes) == {"w"}
    wrapped = loading.wrap("w", full()[4:8].clone())
    assert isinstance(wrapped, BoxTensor) and tuple(wrapped.shape) == (8, 6)
    norm = torch.ones(6)
    assert loading.wrap("norm", norm) is norm
