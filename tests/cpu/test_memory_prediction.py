"""The memory view against a measured step on this machine: a decoder (``benchmarks/llm.py``)
trained one step on CPU under ``@spmd.parallelize``, its allocations recorded by
``torch.profiler`` (``benchmarks/memory.py``), with and without activation
checkpointing: the predicted peak is within 10% of the measured one, and checkpointing
lowers both."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import llm  # noqa: E402
import memory  # noqa: E402

CONFIG = llm.scaled(llm.LLAMA3_8B, layers=2, dim=128, heads=4, kv_heads=2, ffn=384,
                    vocab=2048)


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return {(s, c): memory.measure(CONFIG, 128, 4, s, c)[:2]
            for s, c in (("ddp", "none"), ("ddp", "full"), ("fsdp", "full"))}


@pytest.mark.parametrize("case", [("ddp", "none"), ("ddp", "full"), ("fsdp", "full")])
def test_the_predicted_peak_is_within_ten_percent_of_the_measured_one(measured, case):
    predicted, actual = measured[case]
    assert abs(predicted - actual) <= 0.10 * actual, (predicted, actual)


def test_checkpointing_lowers_the_measured_and_the_predicted_peak(measured):
    (p_none, m_none), (p_full, m_full) = measured[("ddp", "none")], measured[("ddp", "full")]
    assert m_full < m_none and p_full < p_none
    # the prediction's saving is the measured saving, within 10% of the measured peak
    assert abs((p_none - p_full) - (m_none - m_full)) <= 0.10 * m_none
