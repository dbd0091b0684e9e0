"""``end_process_group``: 2 gloo processes (``tests/workers/process_group_exit.py``) that end their process group reach
the interpreter's exit with no group and none of gloo's threads; the control, a group left as Lightning leaves a gloo
one, reaches it with the group and its threads, the threads that abort a process when one of them needs the GIL while
the interpreter finalizes. Without a group, it does nothing. Through ``train.py``: ``tests/distributed/test_ddp.py``
and ``test_fsdp.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recipes.process_group import end_process_group
from tests.conftest import ROOT, child_env, free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")


def at_exit(out: Path, mode: str) -> list[dict]:
    """What each rank of ``process_group_exit.py MODE`` recorded at its exit, in rank order."""
    out.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "process_group_exit.py"), str(out), mode],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(TEST_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def test_an_ended_group_leaves_no_gloo_thread_to_the_exit_and_a_left_one_does(tmp_path: Path) -> None:
    assert at_exit(tmp_path / "ended", "ended") == [{"group": False, "threads": []}] * 2
    rank0, rank1 = at_exit(tmp_path / "left", "left")  # the control
    assert rank0["group"] and rank1["group"]
    assert {"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"} <= set(rank0["threads"])  # rank 0 hosts the store
    assert {"pt_gloo_runloop", "gloo_tcp_loop"} <= set(rank1["threads"])


def test_without_a_process_group_it_does_nothing() -> None:
    assert not dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()
