"""A publish's buckets: which layers go together, and tensors copied into a bucket's host buffer and read
back as views of it, through pickle as the object store hands them out."""

import numpy as np
import pytest
import ray.cloudpickle as pickle
import torch

from dapo_ray.buckets import bucket_plan, copy_into, unpack_bucket


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


def bucket_of(tensors: dict[str, torch.Tensor]):
    buf = torch.empty(4096, dtype=torch.uint8)
    offset, specs = 0, []
    for name, t in tensors.items():
        spec, offset = copy_into(buf, offset, name, t)
        specs.append(spec)
    return specs, buf[:offset].numpy()


def test_a_bucket_round_trips_every_dtype_and_shape_through_pickle():
    original = state()
    specs, buf = bucket_of(original)
    assert buf.dtype == np.uint8 and all(s.offset % 64 == 0 for s in specs)
    out = dict(unpack_bucket(pickle.loads(pickle.dumps((specs, buf), protocol=5))))
    assert list(out) == list(original)
    for name, t in original.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_reading_a_bucket_copies_nothing():
    specs, buf = bucket_of({"w": torch.ones(4, 4), "b": torch.full((2,), 3.0)})
    buf.flags.writeable = False  # as the object store hands it out
    (_, w), (_, b) = unpack_bucket((specs, buf))
    assert w.data_ptr() == buf.ctypes.data and b.data_ptr() == buf.ctypes.data + 64
    assert float(w.sum()) == 16.0 and b.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65])
def test_odd_sizes(n):
    out = dict(unpack_bucket(bucket_of({"a": torch.ones(n, dtype=torch.uint8), "b": torch.full((2,), 7.0)})))
    assert out["a"].numel() == n and torch.equal(out["b"], torch.full((2,), 7.0))


def test_buckets_hold_consecutive_layers_up_to_the_size_and_a_larger_layer_alone():
    assert bucket_plan([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert bucket_plan([3] * 6, 100) == [[0, 1, 2, 3, 4, 5]]
    assert bucket_plan([9, 9], 8) == [[0], [1]]
    assert bucket_plan([], 8) == []
    sizes = [5, 1, 7, 2, 2, 9, 3]
    plan = bucket_plan(sizes, 8)
    assert [i for b in plan for i in b] == list(range(len(sizes)))  # every layer once, in order
    assert all(sum(sizes[i] for i in b) <= 8 or len(b) == 1 for b in plan)


def test_a_bucket_may_also_hold_one_array_per_tensor():
    original = state()
    specs, buf = bucket_of(original)
    arrays = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in original.values()]
    out = dict(unpack_bucket(pickle.loads(pickle.dumps((specs, arrays), protocol=5))))
    assert all(torch.equal(out[k], t) for k, t in original.items())
