"""PyTorch's own RPC, distributed-autograd, distributed-optimizer and RemoteModule tests,
as torch's test/distributed/rpc/test_tensorpipe_agent.py runs them, with their imports
pointed at spmd.runtime by the harness."""

from tests.torch_suites import harness

harness.install()

from torch_as_spmd.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)
from torch_as_spmd.distributed.rpc_utils import (  # noqa: E402
    GENERIC_TESTS,
    TENSORPIPE_TESTS,
    generate_tests,
)

# TorchScript suites are torch's own (harness.TORCH_ONLY): left out
SUITES = [t for t in GENERIC_TESTS + TENSORPIPE_TESTS if not t.__name__.startswith("Jit")]

globals().update(generate_tests("TensorPipe", TensorPipeRpcAgentTestFixture, SUITES, __name__))
