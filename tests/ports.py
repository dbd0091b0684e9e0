"""Ports for the rendezvous of the processes a test starts (``MASTER_PORT``, ``TEST_PORT``): no two allocations get the
same port, whether they are made in one process, in the suite's two xdist workers, or in two suites run side by side.

``free_port()`` hands out the ports of ``PORTS`` in turn, from a cursor kept in one file (``STATE``, under the
system's temporary directory, so every process on the machine shares it) that it reads and advances under an
exclusive ``flock``: two callers never read the same cursor, and a port comes round again only after every other
port of the range has been handed out. A port that something is bound to now (a run still going, a connection in
``TIME_WAIT``) is skipped.

``PORTS`` lie below Linux's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default),
the ports the kernel picks for ``bind(("", 0))`` and for outgoing connections: between the allocation and the
child's own bind, no one else's socket is given the port (gloo's connections, Lightning's ``find_free_network_port``).

What it replaces: bind port 0, close, return the number. The kernel may give that number to the next ``bind(0)``
anywhere on the machine, another test's allocation among them, or to an outgoing connection before the child binds
it (``tests/distributed/test_ports.py`` shows both).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

PORTS = range(20000, 30000)
STATE = Path(tempfile.gettempdir()) / "copy_correct_test_ports"


def bindable(port: int) -> bool:
    """Whether a TCP socket can bind ``port`` on every interface now."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(state: Path = STATE, ports: range = PORTS) -> str:
    """The next port of ``ports`` that no earlier allocation through ``state`` was given since the range last came
    round, and that nothing is bound to now."""
    fd = os.open(state, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = os.pread(fd, 32, 0).decode()
        cursor = int(text) if text.isdigit() else 0
        for step in range(len(ports)):
            port = ports[(cursor + step) % len(ports)]
            if bindable(port):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str((cursor + step + 1) % len(ports)).encode(), 0)
                return str(port)
        raise RuntimeError(f"no port of {ports.start}-{ports.stop - 1} can be bound")
    finally:
        os.close(fd)  # releases the lock
