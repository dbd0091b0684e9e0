"""CUDA-only proofs for ``sample(..., device=)`` of both replay buffers: the batch is on the device, holds the values
the CPU batch of the same draw holds, and every field was copied from pinned host memory without a wait
(``non_blocking=True``); the control, a pageable batch copied as stable-baselines3 copies it, is what the recorder
flags. A buffer on CUDA sampled onto the CPU gives the same values."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from copy_correct import FrameReplayBuffer, ReplayBuffer
from tests.conftest import CUDA
from tests.parts.test_prefetch import ToCopyCalls

pytestmark = [pytest.mark.gpu, CUDA]

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")


def vectors() -> ReplayBuffer:
    buffer = ReplayBuffer(1000, (4,))
    for i in range(300):
        obs = np.full(4, i, np.float32)
        buffer.add(obs, i % 2, float(i), obs + 1, i % 7 == 6, False)
    return buffer


def stacks() -> ReplayBuffer:
    """Whole Atari stacks: a batch of 32 is 0.9 MB a field, gathered by torch's ``index_select`` (with 2+ threads)."""
    buffer = ReplayBuffer(400, (4, 84, 84), obs_dtype=np.uint8)
    rng = np.random.default_rng(1)
    for step in range(300):
        stack = rng.integers(0, 256, (4, 84, 84), dtype=np.uint8)
        buffer.add(stack, step % 4, float(step), stack[::-1].copy(), step % 50 == 49, False)
    return buffer


def frames() -> FrameReplayBuffer:
    buffer = FrameReplayBuffer(400, gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(4))
    rng = np.random.default_rng(0)
    stack = np.repeat(rng.integers(0, 256, (1, 84, 84), dtype=np.uint8), 4, axis=0)
    for step in range(300):
        next_stack = np.concatenate([stack[1:], rng.integers(0, 256, (1, 84, 84), dtype=np.uint8)])
        end = step % 50 == 49
        buffer.add(stack, step % 4, float(step), next_stack, end, False)
        stack = np.repeat(rng.integers(0, 256, (1, 84, 84), dtype=np.uint8), 4, axis=0) if end else next_stack
    return buffer


@pytest.mark.parametrize("make", [vectors, stacks, frames], ids=["vectors", "whole stacks", "FrameReplayBuffer"])
@pytest.mark.parametrize("batch_size", [32, 256])
def test_a_cuda_sample_comes_from_pinned_memory_without_a_wait_and_holds_the_cpu_batchs_values(
    make: object, batch_size: int
) -> None:
    buffer = make()  # type: ignore[operator]
    on_cpu = buffer.sample(batch_size, generator=torch.Generator().manual_seed(5))
    with ToCopyCalls() as calls:
        on_cuda = buffer.sample(batch_size, generator=torch.Generator().manual_seed(5), device="cuda")
    torch.cuda.synchronize()
    assert sorted(on_cuda) == sorted(FIELDS)
    for name in FIELDS:
        assert on_cuda[name].device.type == "cuda", name
        assert on_cuda[name].dtype == on_cpu[name].dtype and torch.equal(on_cuda[name].cpu(), on_cpu[name]), name
    assert len(calls.calls) == len(FIELDS)
    assert all(call["pinned"] and call.get("non_blocking") for call in calls.calls), calls.calls
    # Control: the same batch copied from pageable memory, as stable-baselines3's th.tensor(array, device=) copies.
    with ToCopyCalls() as calls:
        on_cpu["obs"].to("cuda", non_blocking=True)
    assert not calls.calls[0]["pinned"]


def test_a_buffer_on_cuda_samples_onto_the_cpu_the_values_it_holds() -> None:
    buffer = ReplayBuffer(100, (4,), device="cuda")
    for i in range(60):
        obs = np.full(4, i, np.float32)
        buffer.add(obs, i % 2, float(i), obs + 1, False, False)
    on_cuda = buffer.sample(64, generator=torch.Generator().manual_seed(1))
    on_cpu = buffer.sample(64, generator=torch.Generator().manual_seed(1), device="cpu")
    assert all(on_cpu[k].device.type == "cpu" and torch.equal(on_cpu[k], on_cuda[k].cpu()) for k in FIELDS)
