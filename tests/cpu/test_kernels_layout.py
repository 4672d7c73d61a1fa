"""The multi-tensor launch layout: offsets, merged strides, and chunk tables that cover
every element of every tensor exactly once."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.kernels import layout
from spmd.kernels.layout import aligned, collapse, launch_layout, offsets, overlaps_itself


def test_offsets_are_running_sums_without_padding():
    assert offsets([3, 0, 2, 5]) == [0, 3, 3, 5]
    assert offsets([]) == []


def test_collapse_merges_dimensions_that_walk_memory_together():
    assert collapse(torch.empty(2, 3, 4)) == ((24,), (1,))
    assert collapse(torch.empty(1, 5, 1)) == ((5,), (1,))
    assert collapse(torch.empty(())) == ((), ())
    assert collapse(torch.empty(3, 4).t()) == ((4, 3), (1, 4))
    assert collapse(torch.empty(4, 6)[:, :3]) == ((4, 3), (6, 1))
    assert collapse(torch.empty(10)[::2]) == ((5,), (2,))
    assert collapse(torch.empty(3, 1).expand(3, 4)) == ((3, 4), (1, 0))
    nhwc = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert collapse(nhwc) == ((2, 3, 20), (60, 1, 3))


def test_collapse_keeps_logical_order():
    """Walking the collapsed sizes/strides row-major visits t.reshape(-1) in order."""
    base = torch.arange(2 * 3 * 4 * 5.0)
    t = base.view(2, 3, 4, 5).permute(2, 0, 3, 1)[1:, :, ::2]
    sizes, strides = collapse(t)
    index = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(sizes, strides):
        index = index.unsqueeze(-1) + torch.arange(size) * stride
    assert torch.equal(base[t.storage_offset() + index.reshape(-1)], t.reshape(-1))


def test_overlaps_itself():
    assert not overlaps_itself((4, 3), (1, 4))
    assert not overlaps_itself((5,), (2,))
    assert overlaps_itself((3, 4), (1, 0))
    assert overlaps_itself((3, 3), (1, 2))  # torch.as_strided windows
    assert not overlaps_itself((), ())


def test_aligned_needs_aligned_addresses_counts_and_offsets():
    assert aligned([0, 32], 16, 8)
    assert not aligned([8], 16, 8)
    assert not aligned([0], 12, 8)
    assert not aligned([0], 16, 4)


def _covered(launch, numels):
    rows = launch.rows.view(-1, launch.width)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for row, first in launch.chunks.view(-1, 2).tolist():
        n = int(rows[row, 1])
        seen[row][first:min(n, first + launch.chunk)] += 1
    return seen


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=20))
def test_chunks_cover_every_element_once(numels):
    rows = [(1000 * i, n, 0) for i, n in enumerate(numels)]
    launch = launch_layout(rows, torch.device("cpu"))
    assert launch.block & (launch.block - 1) == 0 and launch.block <= layout.MAX_BLOCK
    assert launch.chunk % launch.block == 0
    assert launch.grid == sum(-(-n // launch.chunk) for n in numels)
    assert launch.chunks.view(-1, 2)[:, 1].remainder(launch.chunk).eq(0).all()
    for count in _covered(launch, numels):
        assert count.eq(1).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=20), st.integers(0, 5000))
def test_chunks_on_the_flat_grid_cover_every_element_once(numels, start):
    """On the flat buffer's grid every chunk starts at a multiple of ``chunk`` in the flat
    buffer, and the chunks still cover each element of each tensor exactly once."""
    rows, at = [], start
    for i, n in enumerate(numels):
        rows.append((1000 * i, n, at))
        at += n
    launch = launch_layout(rows, torch.device("cpu"), on_flat_grid=True)
    table = launch.rows.view(-1, launch.width)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for row, first in launch.chunks.view(-1, 2).tolist():
        assert (int(table[row, 2]) + first) % launch.chunk == 0
        n = int(table[row, 1])
        assert first > -launch.chunk and first < n  # the chunk holds some of the tensor
        seen[row][max(first, 0):min(n, first + launch.chunk)] += 1
    for count in seen:
        assert count.eq(1).all()


def test_tiny_tensors_get_small_blocks_and_one_program_each():
    launch = launch_layout([(8 * i, 1 + i % 3, 0) for i in range(100)], torch.device("cpu"))
    assert (launch.block, launch.chunk, launch.grid) == (16, 16, 100)


def test_tables_are_cached_by_content():
    rows = [(64, 10, 0), (128, 5, 10)]
    first = launch_layout(rows, torch.device("cpu"))
    assert launch_layout([list(r) for r in rows], torch.device("cpu")) is first
    assert launch_layout([(64, 10, 0), (128, 6, 10)], torch.device("cpu")) is not first


def test_empty_launch():
    launch = launch_layout([(64, 0, 0)], torch.device("cpu"))
    assert launch.grid == 0
