"""``tests.ports.free_port``, the port of each multi-process test's rendezvous: two processes allocating at once (the
suite's two xdist workers, or two suites) never get the same port, none is given twice before the range comes round,
a port in use is skipped, and no port lies where the kernel picks ports itself. The controls: the way it replaced
(bind port 0, close) hands the same port out twice, and its ports lie in the kernel's range."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env
from tests.ports import PORTS, bindable, free_port

COUNT = 2000  # per process: the old way repeats a port in far fewer draws (birthday odds over ~28,000 ports)
ALLOCATE = """
import sys, time
from pathlib import Path
from tests.ports import free_port
state, ready, go, count = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
ready.touch()
while not go.exists():
    time.sleep(0.001)
print(" ".join(free_port(state) for _ in range(count)))
"""


def bind_zero_port() -> str:
    """The way ``free_port`` used to work: the port the kernel picks for port 0, closed and returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def kernel_range() -> range:
    """The ports the kernel picks for port 0 and for outgoing connections (Linux)."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not path.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
    low, high = map(int, path.read_text().split())
    return range(low, high + 1)


def test_two_processes_allocating_at_once_never_share_a_port(tmp_path: Path) -> None:
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    command = [sys.executable, "-c", ALLOCATE, str(tmp_path / "state")]
    processes = [
        subprocess.Popen([*command, str(flag), str(go), str(COUNT)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env=child_env())
        for flag in ready
    ]  # fmt: skip
    while not all(flag.exists() for flag in ready) and all(p.poll() is None for p in processes):
        time.sleep(0.001)
    go.touch()  # both start allocating now
    ports = [p.communicate(timeout=300)[0].split() for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    every = ports[0] + ports[1]
    assert len(every) == 2 * COUNT and len(set(every)) == 2 * COUNT
    assert all(int(port) in PORTS for port in every)


def test_a_port_comes_round_again_only_after_the_whole_range_and_one_in_use_is_skipped(tmp_path: Path) -> None:
    start = next(p for p in PORTS if all(bindable(q) for q in range(p, p + 3)))
    ports = range(start, start + 3)
    state = tmp_path / "state"
    assert [free_port(state, ports) for _ in range(4)] == [str(p) for p in (start, start + 1, start + 2, start)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", start + 1))
        taken.listen()
        assert free_port(state, ports) == str(start + 2)  # start + 1 is skipped while it is bound
    assert free_port(state, ports) == str(start)


def test_no_port_lies_where_the_kernel_picks_ports(tmp_path: Path) -> None:
    kernel = kernel_range()
    assert not any(int(free_port(tmp_path / "state")) in kernel for _ in range(100))
    assert all(int(bind_zero_port()) in kernel for _ in range(100))  # the control: every old port is the kernel's


def test_control_the_old_way_hands_the_same_port_out_twice() -> None:
    drawn = [bind_zero_port() for _ in range(COUNT)]
    assert len(set(drawn)) < len(drawn)
