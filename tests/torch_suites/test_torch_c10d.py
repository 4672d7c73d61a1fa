"""PyTorch's own c10d tests over Gloo (torch's test/distributed/test_distributed_spawn.py,
``DistributedTest._DistTestBase``), with their imports pointed at spmd.runtime by the
harness: process groups, collectives, point-to-point, objects, and torch's own DDP on a
group created by spmd.runtime."""

import os
import tempfile

from tests.torch_suites import harness

# what torch's run_test.py sets for this file
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="spmd-torch-c10d-"))

harness.install()

import torch  # noqa: E402
from torch_as_spmd.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
