"""A program that ran collectives exits cleanly: no "terminate called without an active
exception" from a backend thread that finished a work while the interpreter shut down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from spmd.runtime.launch import free_port

# Rank 0 starts an all_reduce and exits without waiting for it; rank 1 joins it late, while
# rank 0's main thread holds the GIL in its last exit handler (a long switch interval makes
# every other thread wait for the GIL until it is released), so Gloo's thread finishes the
# work then and waits for the GIL to release the work's tensors. Shutdown begins, a
# finalizer hands the GIL over, and that thread is stopped inside the work's destructor
# unless Python, not Gloo's thread, holds the last reference to the work.
PROGRAM = textwrap.dedent("""
    import atexit, os, sys, time

    rank = int(os.environ["RANK"])

    def exit_slowly():  # registered first, so it runs last
        if rank == 0:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                pass

    atexit.register(exit_slowly)

    import torch
    from spmd import runtime as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
                            rank=rank, world_size=2)
    if rank == 0:
        sys.setswitchinterval(60)
        dist.all_reduce(torch.ones(4), async_op=True)  # never waited for

        class ReleasesTheGilDuringShutdown:
            def __del__(self):
                time.sleep(0.2)

        keep = ReleasesTheGilDuringShutdown()
    else:
        time.sleep(0.3)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [2.0] * 4
    print("done", rank)
""")


def test_exit_with_a_collective_in_flight_does_not_abort(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "PORT": port})
             for r in range(2)]
    outs = [p.communicate(timeout=90) for p in ranks]
    for r, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert "terminate called" not in err, f"rank {r}: {err}"
        assert p.returncode == 0 and out.strip() == f"done {r}", f"rank {r}: {err}"
