"""PyTorch's own c10d tests over Gloo (torch's test/distributed/test_distributed_spawn.py,
``DistributedTest._DistTestBase``), with their imports pointed at spmd.runtime by the
harness: process groups, collectives, point-to-point, objects, and torch's own DDP on a
group created by spmd.runtime."""

import multiprocessing
import os
import tempfile

from tests.torch_suites import harness

# What torch's run_test.py sets for this file. Its ranks (spawned processes that import
# this module) keep them; in the pytest process they are set only while the suite runs.
_ENV = {"BACKEND": "gloo", "WORLD_SIZE": "2",
        "TEMP_DIR": tempfile.mkdtemp(prefix="spmd-torch-c10d-")}
_SAVED = {k: os.environ.get(k) for k in (*_ENV, "MASTER_ADDR", "MASTER_PORT")}


def _apply() -> None:
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)


def _restore() -> None:
    for key, value in _SAVED.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_apply()
harness.install()

import torch  # noqa: E402
from torch_as_spmd.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if multiprocessing.current_process().name == "MainProcess":
    _restore()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    @classmethod
    def setUpClass(cls):
        _apply()
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        _restore()

    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
