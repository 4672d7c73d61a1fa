"""PyTorch's own store and rendezvous tests (test/distributed/test_store.py), with their
imports pointed at spmd.runtime by the harness.

That file is not in the torch wheel and is not copied here: set ``SPMD_TORCH_TESTS`` to a
PyTorch source checkout's ``test`` directory to run it; without it, this module is
skipped."""

import os

import pytest

from tests.torch_suites import harness

_SOURCE = os.path.join(os.environ.get("SPMD_TORCH_TESTS", ""), "distributed", "test_store.py")
if not os.environ.get("SPMD_TORCH_TESTS") or not os.path.exists(_SOURCE):
    pytest.skip("set SPMD_TORCH_TESTS to a PyTorch checkout's test/ directory to run "
                "its test/distributed/test_store.py", allow_module_level=True)

_module = harness.load_file(_SOURCE, "test_store",
                            also=("torch.testing._internal.common_distributed",))
# the test classes that file defines, as if they were this module's
globals().update({name: value for name, value in vars(_module).items()
                  if isinstance(value, type) and value.__module__ == _module.__name__})
