"""The vision tower's vectorised geometry and batched segment attention
against plain per-window / per-segment loops (the tower as a whole is
checked against transformers in test_qwen2_5_vl.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_actors.models.loader import load_model
from mstar_actors.models.vision import Segments, frame_bounds, window_order

from .vl_factories import make_hf_vl_model, make_pixels

GRIDS = [(1, 6, 10), (2, 8, 8), (3, 14, 18), (1, 2, 2)]


def loop_window_order(grids, merge, cells_per_window):
    """The reference: slice every window out of every frame, in order."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for ti in range(t):
            for r0 in range(0, gh, cells_per_window):
                for c0 in range(0, gw, cells_per_window):
                    cells = index[ti, r0 : r0 + cells_per_window, c0 : c0 + cells_per_window].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), bounds


@pytest.mark.parametrize("cells_per_window", [1, 2, 3, 4])
def test_window_order_matches_the_window_loop(cells_per_window):
    order, bounds = window_order(GRIDS, 2, cells_per_window)
    expected_order, expected_bounds = loop_window_order(GRIDS, 2, cells_per_window)
    assert torch.equal(order, expected_order)
    assert bounds == expected_bounds


def test_frame_bounds():
    assert frame_bounds([(2, 2, 4), (1, 4, 4)]) == [0, 8, 16, 32]


@pytest.mark.parametrize(
    "bounds",
    [
        [0, 4, 8, 12],  # equal and back to back: one batch of views
        [0, 4, 6, 10, 12, 16],  # two lengths interleaved: gathered
        [0, 3, 8, 11, 16, 21, 22],  # three lengths, one of them alone
    ],
    ids=["equal", "two-lengths", "mixed"],
)
def test_segments_attend_only_inside_each_segment(bounds):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], 2, 8, generator=gen) for _ in range(3))
    expected = torch.cat([
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:])
    ])
    torch.testing.assert_close(Segments(bounds, "cpu").attend(q, k, v), expected, atol=1e-5, rtol=0)


def test_tower_takes_one_tensor_per_item_and_reuses_its_geometry(tmp_path):
    make_hf_vl_model(tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu")
    grids = [(1, 6, 10), (2, 8, 8)]
    items = [make_pixels(g, seed=i) for i, g in enumerate(grids)]
    with torch.inference_mode():
        joined = model.encode_media(torch.cat(items), grids)
        apart = model.encode_media(items, grids)
    torch.testing.assert_close(apart, joined, atol=1e-6, rtol=0)
    assert len(model.visual._geometries) == 1  # the second call found the first's
    with pytest.raises(ValueError, match=r"need \[188, 24\] rows in all"):
        model.encode_media(items[:1], grids)
