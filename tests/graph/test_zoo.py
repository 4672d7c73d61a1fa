"""The equivalence model zoo (tests/zoo.py) holds what its entries promise: the same
float64 weights every build, batches and a loss that train, block paths that exist."""

from __future__ import annotations

import pytest
import torch

import spmd

from ..zoo import ZOO, all_entries, entry

pytest.importorskip("transformers")

FAMILIES = {"transformer", "encoder", "llama", "gpt2", "mistral", "qwen2", "glm", "mixtral"}


def test_every_family_is_in_the_zoo():
    assert {e.family for e in ZOO.values()} == FAMILIES
    assert all(e.family in FAMILIES for e in all_entries())  # our own LLaMAs too, once added
    with pytest.raises(KeyError, match="no zoo model 'bert'.*llama"):
        entry("bert")


@pytest.mark.parametrize("name", [e.name for e in all_entries()])
def test_an_entry_builds_the_same_model_and_trains(name):
    e = entry(name)
    model, again = e.model(), e.model()
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert a.dtype == torch.float64 and torch.equal(a, b), key
    inputs, targets = e.make_batch(1, 3)
    assert inputs.shape == targets.shape == (3, 8)
    assert torch.equal(inputs, e.make_batch(1, 3)[0])
    assert not torch.equal(inputs, e.make_batch(2, 3)[0])
    loss = e.loss_fn(model(inputs), targets)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    modules = dict(model.named_modules())
    assert all(block in modules for block in e.blocks) and len(e.blocks) == 2
    placed = spmd.tp.megatron(model)["tp"]
    assert all(n.startswith(e.blocks) for n in placed)  # only blocks are split
    assert {n for n in placed if n.startswith(e.block + ".")}


def test_gpt2_keeps_its_embeddings_tied():
    hf = ZOO["gpt2"].model().hf
    assert hf.lm_head.weight is hf.transformer.wte.weight
