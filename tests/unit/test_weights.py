"""Packing weights into one buffer for the object store, and reading them back as views."""

import numpy as np
import pytest
import torch

from dapo_ray.weights import ALIGN, pack, unpack


def test_pack_unpack_round_trips_every_dtype_and_shape():
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the next one is re-aligned
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "lm_head.weight": torch.randn(5, 7, generator=g).t(),  # not contiguous
        "steps": torch.arange(3, dtype=torch.int64),
    }
    specs, buffer = pack(state)
    assert buffer.dtype == np.uint8 and all(s.offset % ALIGN == 0 for s in specs)
    out = dict(unpack((specs, buffer)))
    assert list(out) == list(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_unpack_gives_views_of_a_read_only_buffer_without_copying():
    specs, buffer = pack({"w": torch.ones(4, 4)})
    buffer.flags.writeable = False  # as the object store hands it out
    (name, w), = unpack((specs, buffer))
    assert w.data_ptr() == buffer.ctypes.data
    assert float(w.sum()) == 16.0


def test_pack_copies_so_later_training_does_not_change_a_published_version():
    w = torch.zeros(3)
    specs, buffer = pack({"w": w})
    w += 1
    assert torch.equal(dict(unpack((specs, buffer)))["w"], torch.zeros(3))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65])
def test_sizes_around_the_alignment(n):
    specs, buffer = pack({"a": torch.ones(n, dtype=torch.uint8), "b": torch.full((2,), 7.0)})
    out = dict(unpack((specs, buffer)))
    assert out["a"].numel() == n and torch.equal(out["b"], torch.full((2,), 7.0))
