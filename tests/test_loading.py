"""load_shard: every rank reads exactly its own block of a sample, through numpy's memmap."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import autojigsaw

SHAPE = (2, 3, 7, 10)  # 7 latitudes do not divide by 2 or 4


def _mesh(sizes: tuple[int, ...], rank: int) -> DeviceMesh:
    """The mesh as rank `rank` sees it (no process group: load_shard only reads coordinates)."""
    ranks = torch.arange(int(np.prod(sizes))).reshape(sizes)
    return DeviceMesh("cpu", ranks, mesh_dim_names=("domain", "tensor")[:len(sizes)],
                      _init_backend=False, _rank=rank)


@pytest.fixture
def field(tmp_path):
    data = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    path = tmp_path / "field.npy"
    np.save(path, data)
    return path, data


@pytest.mark.parametrize("sizes,placements", [
    ((2, 2), (Shard(2), Shard(3))),  # latitude x longitude
    ((2, 2), (Shard(2), Shard(2))),  # latitude over both axes: 2 + 2 + 2 + 1 rows
    ((2, 2), (Shard(2), Replicate())),
    ((4,), (Shard(1),)),  # 3 channels over 4 ranks: one rank reads nothing
])
def test_each_rank_reads_exactly_its_block(field, sizes, placements):
    path, data = field
    asked = []

    def read(index):
        asked.append(index)
        return np.load(path, mmap_mode="r")[index]

    for rank in range(int(np.prod(sizes))):
        mesh = _mesh(sizes, rank)
        shard = autojigsaw.load_shard(read, SHAPE, placements, mesh)
        assert torch.equal(shard, _dtensor_local(data, mesh, placements)), rank
        assert shard.dtype == torch.float32
    # one read per rank, of that rank's block only
    assert len(asked) == np.prod(sizes)
    read_elements = sum(int(np.prod([s.stop - s.start for s in index])) for index in asked)
    replicas = int(np.prod([n for n, p in zip(sizes, placements) if not isinstance(p, Shard)]))
    assert read_elements == data.size * replicas


def _dtensor_local(data, mesh, placements):
    """DTensor's own local block of `data` on this rank."""
    shape, offset = compute_local_shape_and_global_offset(data.shape, mesh, placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return torch.from_numpy(np.ascontiguousarray(data[index]))


def test_bad_placements_name_the_axis():
    mesh = _mesh((2, 2), 0)
    with pytest.raises(ValueError, match="1 placements for a mesh of 2 axes"):
        autojigsaw.load_shard(lambda i: None, SHAPE, (Shard(0),), mesh)
    with pytest.raises(ValueError, match=r"P\(sum\).*axis 'tensor'.*not a slice"):
        autojigsaw.load_shard(lambda i: None, SHAPE, (Shard(0), Partial()), mesh)
    with pytest.raises(ValueError, match=r"S\(4\) on axis 'domain'"):
        autojigsaw.load_shard(lambda i: None, SHAPE, (Shard(4), Replicate()), mesh)


def test_reader_must_return_the_slice_asked_for():
    with pytest.raises(ValueError, match="read_fn returned shape"):
        autojigsaw.load_shard(lambda index: np.zeros(SHAPE), SHAPE, (Shard(2), Replicate()),
                              _mesh((2, 2), 3))


def test_stand_in_has_the_shape_but_one_element():
    x = autojigsaw.stand_in(SHAPE, torch.float64)
    assert x.shape == SHAPE and x.dtype == torch.float64 and x.untyped_storage().nbytes() == 8
