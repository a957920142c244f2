"""``data.left_pad_positions``: the position ids of a left-padded batch, the one rule of the sampler and
of RL's scoring and update (the mismatch metric compares tokens scored at these positions)."""

from __future__ import annotations

import torch

from infir2.data import left_pad_positions


def test_positions_by_hand():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # a prompt left-padded by two
            [1, 1, 1, 1, 1],  # no padding
            [0, 0, 0, 0, 1],  # one real token
            [0, 1, 1, 1, 0],  # left-padded prompt, right-padded response (RL's rows)
            [0, 0, 0, 0, 0],  # all padding
        ]
    )
    expected = torch.tensor(
        [
            [0, 0, 0, 1, 2],
            [0, 1, 2, 3, 4],
            [0, 0, 0, 0, 0],
            [0, 0, 1, 2, 2],
            [0, 0, 0, 0, 0],
        ]
    )
    assert torch.equal(left_pad_positions(mask), expected)


def test_each_real_token_sits_where_it_would_unpadded():
    """A row's real tokens get 0, 1, 2, ... whatever the padding before them, as in a batch of one."""
    for pad in range(4):
        mask = torch.tensor([[0] * pad + [1] * 6])
        assert torch.equal(left_pad_positions(mask)[0, pad:], torch.arange(6))
