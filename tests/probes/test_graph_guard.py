"""GraphRetentionGuard in a plain PyTorch loop: ``check`` after every step.

The loop is the PyTorch DCGAN example's, small: a generator and a discriminator, ``BCELoss``, two Adam optimizers,
``fake = netG(noise)`` once per step, ``fake.detach()`` for the discriminator's step, losses kept as numbers, and
progress samples of ``netG(fixed_noise)`` taken under ``no_grad``. The control forgets ``no_grad`` for one sample:
the guard stops that step, with the bytes that sample's graph keeps alive, to the byte what MemoryProbe measures
the same step to leave behind. (Its Lightning callback is tested in ``tests/lightning/test_graph_guard.py`` and
``tests/recipes/test_metrics.py``.)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from copy_correct.probes import GraphRetentionError, GraphRetentionGuard, MemoryProbe
from copy_correct.probes._storage_events import human_bytes
from tests.probes.test_graph_refs import dcgan_generator  # noise (n, NZ, 1, 1) -> images (n, 1, 16, 16)

NZ, NGF, NDF, BATCH, STEPS = 8, 8, 8, 16, 6


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tensors this small run faster on one thread, and a second one only adds waiting on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _discriminator() -> nn.Sequential:  # images -> probability of real, (n, 1, 1, 1)
    return nn.Sequential(
        nn.Conv2d(1, NDF, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
        nn.BatchNorm2d(NDF * 2),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
        nn.Sigmoid(),
    )


def _train(
    guard: GraphRetentionGuard,
    *,
    leak_at: int | None = None,
    loss_graphs: bool = False,
    probe: MemoryProbe | None = None,
    probe_at: int = -1,
) -> list[list[tuple[str, int]]]:
    """The DCGAN loop, ``guard.check`` after every step; what each check returned.

    ``leak_at``: the step whose sample is taken without ``no_grad`` (the control). ``loss_graphs``: keep ``errG``
    itself, after its backward, instead of ``errG.item()``. ``probe`` measures step ``probe_at``.
    """
    torch.manual_seed(0)
    netG, netD = dcgan_generator(NZ, NGF), _discriminator()
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    fixed_noise = torch.randn(BATCH, NZ, 1, 1)
    data = torch.rand(STEPS, BATCH, 1, 16, 16) * 2 - 1
    img_list: list[torch.Tensor] = []
    G_losses: list[float | torch.Tensor] = []
    D_losses: list[float] = []
    checks = []
    for i, real in enumerate(data):
        if i == probe_at:
            probe.__enter__()
        # (1) update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        label = torch.full((BATCH,), 1.0)
        errD_real = criterion(netD(real).view(-1), label)
        errD_real.backward()
        fake = netG(torch.randn(BATCH, NZ, 1, 1))
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()).view(-1), label)
        errD_fake.backward()
        optimizerD.step()
        # (2) update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake).view(-1), label)
        errG.backward()
        optimizerG.step()
        G_losses.append(errG if loss_graphs else errG.item())
        D_losses.append((errD_real + errD_fake).item())
        if i == leak_at:
            img_list.append(netG(fixed_noise))  # the bug: no no_grad, never backpropagated
        else:
            with torch.no_grad():
                img_list.append(netG(fixed_noise))
        if i == probe_at:
            probe.__exit__(None, None, None)
        checks.append(guard.check(i, netG=netG, netD=netD, samples=img_list, G_losses=G_losses, noise=fixed_noise))
    return checks


def test_the_correct_loop_passes_every_step() -> None:
    assert _train(GraphRetentionGuard()) == [[]] * STEPS


@pytest.mark.parametrize("k", [0, 3])
def test_a_sample_taken_without_no_grad_stops_that_step_with_the_bytes_memory_probe_sees(k: int) -> None:
    """The guard stops step k, not earlier, naming the sample and its graph's bytes. MemoryProbe measures step k of
    the control and of the correct loop (the same seed, one line apart): the difference, what the forgotten no_grad
    left behind, equals the bytes reported to the byte (tolerance 0: both count whole storages, each once)."""
    leaking, correct = MemoryProbe(), MemoryProbe()
    with pytest.raises(GraphRetentionError, match=rf"^step {k}: 1 tensor\(s\) .*: samples\[{k}\] \(") as raised:
        _train(GraphRetentionGuard(), leak_at=k, probe=leaking, probe_at=k)
    _train(GraphRetentionGuard(), probe=correct, probe_at=k)
    growth = leaking.net_bytes - correct.net_bytes
    print(f"step {k}: MemoryProbe {leaking.net_bytes} B - {correct.net_bytes} B = {growth} B; {raised.value}")
    assert growth > 50_000  # the generator's activations for 16 samples
    assert f"samples[{k}] ({human_bytes(growth)})" in str(raised.value)
    assert f"keeping {human_bytes(growth)} alive in all" in str(raised.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks = _train(GraphRetentionGuard(mode="warn"), leak_at=k)  # warns each step the sample is kept
    assert [str(w.message).partition(":")[0] for w in caught] == [f"step {i}" for i in range(k, STEPS)]
    assert checks[:k] == [[]] * k  # nothing before step k
    assert checks[k] == [(f"samples[{k}]", growth)]  # the exact bytes, from check's return value


def test_a_tensor_the_loop_holds_is_not_counted_as_kept_by_the_graph() -> None:
    """The sample's graph saved ``fixed_noise``, which the loop holds anyway (passed as ``noise``). Control: a search
    that does not see it counts it among the graph's bytes."""
    torch.manual_seed(0)
    netG, fixed_noise = dcgan_generator(NZ, NGF), torch.randn(BATCH, NZ, 1, 1)
    samples = [netG(fixed_noise)]
    guard = GraphRetentionGuard(mode="warn")
    with pytest.warns(RuntimeWarning):
        (seen,) = guard.check(0, netG=netG, samples=samples, noise=fixed_noise)
    with pytest.warns(RuntimeWarning):
        (unseen,) = guard.check(0, netG=netG, samples=samples)
    assert unseen[1] - seen[1] == fixed_noise.untyped_storage().nbytes()


def test_losses_kept_after_backward_fail_at_step_0_and_min_bytes_lets_them_pass() -> None:
    """``G_losses.append(errG)`` after ``errG.backward()``: its graph keeps 0 B of tensors but all its nodes, so the
    default guard stops at step 0. With ``min_bytes=1`` it passes them and stops at the sample that keeps
    activations, listing the losses apart."""
    with pytest.raises(GraphRetentionError, match=r"^step 0: 1 tensor\(s\) .*: G_losses\[0\] \(0 B\)\. A graph at 0 B"):
        _train(GraphRetentionGuard(), loss_graphs=True, leak_at=3)
    with pytest.raises(GraphRetentionError) as raised:
        _train(GraphRetentionGuard(min_bytes=1), loss_graphs=True, leak_at=3)
    message = str(raised.value)
    assert message.startswith("step 3: 1 tensor(s)") and "samples[3] (" in message
    assert "Under min_bytes=1: G_losses[0] (0 B), G_losses[1] (0 B), G_losses[2] (0 B), G_losses[3] (0 B)." in message
    checks = _train(GraphRetentionGuard(min_bytes=1), loss_graphs=True)
    assert checks[-1] == [(f"G_losses[{i}]", 0) for i in range(STEPS)]  # returned, though none failed


def test_findings_are_largest_first_and_the_total_counts_a_shared_storage_once() -> None:
    w = nn.Parameter(torch.ones(1000))
    x = torch.randn(1000)
    big = (x * w).sin()  # saves x and the product: 8000 B
    small = x[:10] * w[:10]  # saves a view of x: all of x's 4000 B, which big's graph keeps too
    guard = GraphRetentionGuard()
    with pytest.raises(GraphRetentionError) as raised:
        guard.check(7, kept=[small, big])
    assert str(raised.value).startswith(
        "step 7: 2 tensor(s) still hold an autograd graph after the training step, keeping 7.8 KiB alive in all: "
        "kept[1] (7.8 KiB), kept[0] (3.9 KiB)."
    )
    with pytest.raises(GraphRetentionError, match=r"^2 tensor\(s\)"):  # no step given: none shown
        guard.check(kept=[small, big])
    with pytest.raises(GraphRetentionError, match=r"keeping 3.9 KiB alive in all: kept\[1\] \(3.9 KiB\), kept\[0\]"):
        guard.check(7, kept=[small, big], x=x)  # x held by the searched objects: not the graphs' to free


def test_many_findings_name_ten_and_count_the_rest() -> None:
    w = nn.Parameter(torch.ones(3))
    with pytest.raises(GraphRetentionError, match=r"kept\[9\] \(0 B\) and 2 more\."):
        GraphRetentionGuard().check(0, kept=[w.clone() for _ in range(12)])


def test_a_trainer_reached_from_the_objects_is_not_entered() -> None:
    class Holder:
        pass

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    control = Holder()
    trainer.kept = control.kept = nn.Linear(3, 1)(torch.randn(2, 3))
    assert GraphRetentionGuard().check(0, loop={"trainer": trainer}) == []
    with pytest.raises(GraphRetentionError, match=r"loop\['holder'\]\.kept"):
        GraphRetentionGuard().check(0, loop={"holder": control})


def test_bad_min_bytes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        GraphRetentionGuard(min_bytes=-1)
