"""Weights as uint8 numpy views for the object store, and read back as tensors."""

import numpy as np
import pytest
import ray.cloudpickle as pickle
import torch

from dapo_ray.weights import pack, unpack


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "lm_head.weight": torch.randn(5, 7, generator=g).t(),  # not contiguous
        "steps": torch.arange(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def test_pack_unpack_round_trips_every_dtype_and_shape_through_pickle():
    original = state()
    specs, arrays = pack(original)
    assert all(a.dtype == np.uint8 for a in arrays)
    out = dict(unpack(pickle.loads(pickle.dumps((specs, arrays), protocol=5))))
    assert list(out) == list(original)
    for name, t in original.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_pack_and_unpack_copy_nothing():
    w = torch.ones(4, 4)
    specs, arrays = pack({"w": w})
    assert arrays[0].ctypes.data == w.data_ptr()
    arrays[0].flags.writeable = False  # as the object store hands it out
    (_, back), = unpack((specs, arrays))
    assert back.data_ptr() == w.data_ptr() and float(back.sum()) == 16.0


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65])
def test_odd_sizes(n):
    out = dict(unpack(pack({"a": torch.ones(n, dtype=torch.uint8), "b": torch.full((2,), 7.0)})))
    assert out["a"].numel() == n and torch.equal(out["b"], torch.full((2,), 7.0))
