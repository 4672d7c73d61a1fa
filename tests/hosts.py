"""Many hosts on one machine: network namespaces as hosts, a userspace switch as their
network, and each host's link shaped (bandwidth, latency, loss), also while a job runs.

    with Hosts(2, link=Link(gbps=1, latency_ms=0.5)) as hosts:
        hosts.popen(0, [sys.executable, "train.py"])      # runs inside host 0
        hosts.shape(1, Link(gbps=0.1))                     # host 1's link slows down
        hosts.address(1)                                   # '10.213.0.2'

Each host is a network namespace (``ip netns``) with its own loopback, over which its
ranks talk to each other as GPUs of one node do over NVLink, and one network device,
``eth0``, with the address ``10.213.0.<i+1>/24``. ``eth0`` is a TUN device whose other
end the switch holds: a process in this namespace that forwards every IP packet to the
host its destination address names, after the sending host's link has held it (a queue
serialised at the link's bandwidth, then its one-way latency, then its loss) and the
receiving host's link has serialised it too (an incast is limited by the receiver's
port, as on a real switch).

Why a userspace switch and not veth pairs with ``tc netem``: kernels are often built
without netem (this machine's has only the tbf and htb qdiscs, no netem, fq or gact), and
a switch that shapes by itself works on any kernel with TUN. It forwards 64 KiB packets
(the TUN's MTU is 65000, so a packet is a large TCP segment): a few thousand packets per
second carry a 1 Gbit/s link.

Everything is cleaned up: the processes started in a host (their process groups), the
switch (whose TUN devices vanish with it) and the namespaces, on exit, on an exception,
and, for a harness whose process was killed, by the next harness (namespaces are named
after the pid that made them). Traffic never leaves these namespaces: the switch only
forwards between its own TUN devices.

Needs root, ``ip`` (iproute2) and ``/dev/net/tun``; :func:`unavailable` says why not
where one is missing, for tests to skip with.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import heapq
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["Link", "Hosts", "unavailable", "SUBNET"]

SUBNET = "10.213.0"     # hosts are SUBNET.1, SUBNET.2, ...; only inside the namespaces
MTU = 65000
_PREFIX = "spmdh"        # namespace names: spmdh<pid>-<i>


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One host's link to the switch, both directions.

    Args:
        gbps: bandwidth in Gbit/s, each direction (None: as fast as the switch forwards).
        latency_ms: one-way latency added to every packet the host sends (a round trip
            between hosts a and b takes ``latency_ms`` of a plus that of b).
        loss: the fraction of the host's outgoing packets dropped at random.
        queue_bytes: what the sending queue holds before it drops (tail drop).
        down: the link is cut: nothing leaves the host or reaches it (a partition).
    """

    gbps: float | None = None
    latency_ms: float = 0.0
    loss: float = 0.0
    queue_bytes: int = 4 << 20
    down: bool = False

    def __post_init__(self) -> None:
        if self.gbps is not None and not self.gbps > 0:
            raise ValueError(f"Link gbps must be positive or None, got {self.gbps}")
        if not self.latency_ms >= 0:
            raise ValueError(f"Link latency_ms must be >= 0, got {self.latency_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"Link loss must be in [0, 1), got {self.loss}")
        if self.queue_bytes < MTU:
            raise ValueError(f"Link queue_bytes must hold one packet ({MTU}), got {self.queue_bytes}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why this machine cannot make hosts (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    try:  # the switch's devices: a TUN device made and dropped at once
        os.close(_open_tun(f"sp{os.getpid() % 100000}probe"))
    except OSError as e:
        return f"cannot make a TUN device: {e}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces a harness left behind when its process was killed."""
    listed = _ip("netns", "list", check=False).stdout.split()
    gone = []
    for name in listed:
        if not name.startswith(_PREFIX) or "-" not in name:
            continue
        pid = name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class Hosts:
    """``n`` hosts on one switch; a context manager that always cleans up.

    Args:
        n: how many hosts (at most 250).
        link: every host's link, or one per host.
        timeout: seconds to wait for the switch to start.
    """

    def __init__(self, n: int, link: Link | Sequence[Link] = Link(), *,
                 timeout: float = 30.0) -> None:
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"Hosts needs 1 to 250 hosts, got {n!r}")
        links = [link] * n if isinstance(link, Link) else list(link)
        if len(links) != n or not all(isinstance(x, Link) for x in links):
            raise ValueError(f"Hosts needs one Link or {n} of them, got {link!r}")
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot make hosts here: {why}")
        remove_stale()
        self.n = n
        self.links = links
        self.names = [f"{_PREFIX}{os.getpid()}-{i}" for i in range(n)]
        self._procs: list[subprocess.Popen] = []
        self._switch: subprocess.Popen | None = None
        self._closed = False
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    # set-up -------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        for name in self.names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        devices = [f"st{os.getpid() % 100000}h{i}" for i in range(self.n)]
        self._switch = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "switch", *devices],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True)
        self._expect("ready", timeout)
        for i, (name, device) in enumerate(zip(self.names, devices)):
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "link", "set", device, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "mtu", str(MTU), "up")
        for i, link in enumerate(self.links):
            self.shape(i, link)

    def _expect(self, word: str, timeout: float) -> None:
        assert self._switch is not None and self._switch.stdout is not None
        ready, _, _ = select.select([self._switch.stdout], [], [], timeout)
        line = self._switch.stdout.readline().strip() if ready else ""
        if line != word:
            raise RuntimeError(f"the switch did not answer {word!r} within {timeout:.0f} s "
                               f"(got {line!r}, exit code {self._switch.poll()})")

    # use ----------------------------------------------------------------------------------

    def address(self, i: int) -> str:
        """Host ``i``'s address on the switch."""
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def shape(self, i: int, link: Link) -> None:
        """Give host ``i``'s link new figures; takes effect for the next packet."""
        self._check(i)
        if not isinstance(link, Link):
            raise TypeError(f"shape needs a Link, got {type(link).__name__}")
        assert self._switch is not None and self._switch.stdin is not None
        self._switch.stdin.write(json.dumps({"host": i, **dataclasses.asdict(link)}) + "\n")
        self._switch.stdin.flush()
        self._expect("ok", 10.0)
        self.links[i] = link

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` (its own process group, killed on cleanup)."""
        self._check(i)
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: float = 60.0,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i`` to its end (killed after ``timeout`` seconds)."""
        self._check(i)
        return subprocess.run(["ip", "netns", "exec", self.names[i], *argv],
                              timeout=timeout, **kwargs)

    def _check(self, i: int) -> None:
        if self._closed:
            raise RuntimeError("these hosts are closed")
        if not isinstance(i, int) or not 0 <= i < self.n:
            raise ValueError(f"host index must be in [0, {self.n}), got {i!r}")

    # clean-up -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs in the hosts, stop the switch, delete the namespaces."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _kill_group(proc)
        if self._switch is not None:
            if self._switch.stdin is not None:
                self._switch.stdin.close()
            _kill_group(self._switch)
            if self._switch.stdout is not None:
                self._switch.stdout.close()
        for name in self.names:
            # a process another harness user started with `ip netns exec` must not outlive
            # its host: kill whatever is left in the namespace before deleting it
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# the switch -------------------------------------------------------------------------------

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


class _Timer:
    """A timerfd (absolute CLOCK_MONOTONIC, as ``time.monotonic``) to wake epoll at a
    packet's due time to the microsecond; ``select.epoll.poll`` rounds up to milliseconds."""

    class _Spec(ctypes.Structure):
        _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                    ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.timerfd_create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 us, not the default 50 us

    def arm(self, due: float) -> None:
        seconds = int(due)
        spec = self._Spec(0, 0, seconds, max(1, int((due - seconds) * 1e9)))
        if self.libc.timerfd_settime(self.fd, 1, ctypes.byref(spec), None) != 0:  # ABSTIME
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


class _Port:
    """One host's link as the switch keeps it: the figures and when each direction is next
    free."""

    def __init__(self) -> None:
        self.link = Link()
        self.out_free = 0.0
        self.in_free = 0.0

    def seconds(self, size: int) -> float:
        gbps = self.link.gbps
        return 0.0 if gbps is None else size * 8 / (gbps * 1e9)


def _switch(devices: list[str]) -> None:
    fds = [_open_tun(d) for d in devices]
    ports = [_Port() for _ in devices]
    index = {fd: i for i, fd in enumerate(fds)}
    prefix = bytes(int(x) for x in SUBNET.split("."))
    timer = _Timer()
    poller = select.epoll()
    for fd in fds:
        poller.register(fd, select.EPOLLIN)
    poller.register(timer.fd, select.EPOLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.EPOLLIN)
    pending: list[tuple[float, int, int, bytes]] = []
    seq = 0
    armed = float("inf")
    buffered = b""
    print("ready", flush=True)
    while True:
        for fd, _ in poller.poll():
            if fd == stdin:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return  # the harness is gone: stop, and the TUN devices go with us
                buffered += chunk
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    order = json.loads(line)
                    host = order.pop("host")
                    ports[host].link = Link(**order)
                    print("ok", flush=True)
            elif fd == timer.fd:
                timer.clear()
                armed = float("inf")
            else:
                src = ports[index[fd]]
                for _ in range(64):
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[16:19] != prefix:
                        continue  # not IPv4 to one of our hosts: dropped
                    dst_index = packet[19] - 1
                    if not 0 <= dst_index < len(fds):
                        continue
                    now = time.monotonic()
                    link = src.link
                    if link.down or ports[dst_index].link.down:
                        continue  # a partition: either end's link cut
                    if link.loss and random.random() < link.loss:
                        continue
                    start = max(now, src.out_free)
                    if (start - now) * (link.gbps or 0) * 1e9 / 8 > link.queue_bytes:
                        continue  # the sending queue is full: tail drop
                    src.out_free = start + src.seconds(len(packet))
                    dst = ports[dst_index]
                    arrive = src.out_free + link.latency_ms / 1e3
                    dst.in_free = max(arrive, dst.in_free) + dst.seconds(len(packet))
                    seq += 1
                    heapq.heappush(pending, (dst.in_free, seq, fds[dst_index], packet))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, fd, packet = heapq.heappop(pending)
            try:
                os.write(fd, packet)
            except OSError as e:  # a host whose device is gone or full: the packet is lost
                if e.errno not in (errno.EAGAIN, errno.EIO, errno.EBADFD, errno.EINVAL):
                    raise
        if pending and pending[0][0] < armed:
            armed = pending[0][0]
            timer.arm(armed)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "switch":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _switch(sys.argv[2:])
    else:
        print(f"usage: {sys.argv[0]} switch DEVICE... (started by tests.hosts.Hosts)",
              file=sys.stderr)
        sys.exit(2)
