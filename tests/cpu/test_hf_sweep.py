"""Issue 43's sweep as a test: Hugging Face causal-LM families from tiny configs
(``tests/hf_catalogue.py``) trained 3 AdamW steps with clipping in float64 under ddp, fsdp,
tp (the family's own plan, 2 ranks), fsdp x tp (2 x 2) and, for mixtures of experts, ep
and fsdp x ep (``spmd.ep.experts()``, 2 ranks), ep x tp, pp x ep and cp x ep (2 x 2),
each compared with one process
(``tests/hf_sweep.py`` judges a cell: equal, refused, differs, crash, hang).

Profiles (``SPMD_HF``): ``ci`` (the default) runs :data:`CI`, families chosen for what the
zoo's four do not have (a packed or fused projection, partial rotary, q/k norms, attention
sinks and ``local_params``, an MoE's experts split by their own keys, a state-space
layer); ``full`` every family the installed transformers builds, each cell equal or
refused, and at least 90% of them equal under ddp, fsdp and tp. ``python
benchmarks/hf_sweep.py --readme`` runs the same cells and writes README's table.
"""

from __future__ import annotations

import os

import pytest

from .. import hf_sweep

pytest.importorskip("transformers")

# family -> the strategies CI trains it under (every cell must come out equal)
CI: dict[str, tuple[str, ...]] = {
    "phi": ("ddp", "tp"),                 # partial rotary, biases, a dense head
    "olmo2": ("fsdp", "tp"),              # q and k norms over the split heads
    "granite_swa": ("tp", "fsdp x tp"),   # attention sinks split by their own key
    "qwen3_moe": ("ep x tp",),            # experts beside its split attention, split by both
    "gemma": ("ddp", "fsdp"),             # a scaled, tied embedding
    # experts split by index (sigmoid, grouped top-k) beside a split sequence (its
    # router's gather and scatter_add, the rotary copy_ into a slice keep it split)
    "deepseek_v3": ("cp x ep",),
    "gpt_oss": ("fsdp x ep",),            # experts transposed, biased, an interleaved gate
}


def _profile() -> list[tuple[str, str]]:
    name = os.environ.get("SPMD_HF", "ci")
    if name == "ci":
        return [(f, s) for f, strategies in CI.items() for s in strategies]
    if name != "full":
        raise ValueError(f"SPMD_HF={name!r}: expected ci or full")
    from .. import hf_catalogue

    return [(f, s) for f in hf_catalogue.families() for s in hf_sweep.STRATEGIES]


CELLS = _profile()
_FOUND: dict[tuple[str, str], hf_sweep.Outcome] = {}
_WANT: dict[str, object] = {}


def _want(family: str):
    if family not in _WANT:
        _WANT[family] = hf_sweep.reference(family)
    return _WANT[family]


def _outcome(cell: tuple[str, str]) -> hf_sweep.Outcome:
    """The cell's outcome; its family's cells of the same world size run together."""
    if cell not in _FOUND:
        size = hf_sweep.world(cell[1])
        group = [c for c in CELLS if c[0] == cell[0] and hf_sweep.world(c[1]) == size
                 and c not in _FOUND]
        for o in hf_sweep.sweep(group, timeout=100, chunk=len(group), want=_want):
            _FOUND[o.family, o.strategy] = o
    return _FOUND[cell]


@pytest.mark.parametrize("family,strategy", CELLS, ids=[f"{f}-{s}" for f, s in CELLS])
def test_a_family_trains_like_one_process_or_is_refused(family, strategy):
    if os.environ.get("SPMD_HF", "ci") == "full":
        from .. import hf_catalogue

        _, why = hf_catalogue.try_build(family)
        if why:
            pytest.skip(f"{family} does not build from a tiny config: {why}")
    o = _outcome((family, strategy))
    if o.outcome == "skipped":
        pytest.skip(o.detail)
    allowed = ("equal",) if family in CI else ("equal", "refused")
    assert o.outcome in allowed, f"{family} under {strategy}: {o.outcome}: {o.detail}\n" + (
        next((r["trace"] for r in o.ranks if "trace" in r), ""))
