"""What ``NonFiniteStop`` costs on the ``ema`` recipe, in one process, one CPU thread:

* its per-batch hook (the loss copied on the device) and a check (the losses and the weights read), each against
  a bare training step of the recipe's module (forward, backward, SGD step on a batch of 16 digits): the fastest of
  ``--repeat`` rounds;
* a whole ``fit`` of the recipe as ``train.py`` builds it (``--epochs`` epochs): with the callback, without it
  (``callbacks.nonfinite_stop=null``), and with an empty ``lightning.pytorch.Callback`` in its place (what Lightning's
  calling every hook of one more callback costs), interleaved, rotating which goes first; the first round warms up.

    python -m benchmarks.nonfinite_stop [--repeat 8] [--epochs 3]

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from copy_correct.lightning import NonFiniteStop
from recipes.build import build
from recipes.launch import CONF_DIR


class _Trainer:
    """The trainer as the callback's hooks read it: one process, at global step 0 of epoch 0."""

    global_step, current_epoch, world_size, sanity_checking = 0, 0, 1, False


def _per_call(action: Callable[[], object], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            action()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _config(folder: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        quiet = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
        return compose("config", overrides=[f"paths.output_dir={folder}", "+recipe=ema", *quiet, *overrides])


def hooks(folder: Path, repeat: int) -> tuple[float, float, float]:
    """Seconds per bare training step, per batch hook and per check, on the ema recipe's module."""
    _, model, _ = build(_config(folder))
    x, y = torch.rand(16, 64), torch.randint(10, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model.net(x), y)
        loss.backward()
        optimizer.step()
        return loss

    stop, loss = NonFiniteStop(every_n_steps=50), step().detach()

    def batch() -> None:
        stop.on_train_batch_end(_Trainer(), model, {"loss": loss}, None, 0)
        stop._batches.clear()  # stay within one window: the hook alone, never a check

    return (
        _per_call(step, 200, repeat),
        _per_call(batch, 2000, repeat),
        _per_call(lambda: stop.check(_Trainer(), model), 200, repeat),
    )


def fits(folder: Path, repeat: int, epochs: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of ``trainer.fit`` with the callback, without it and with an empty one, interleaved; the steps of one."""
    runs = [
        ("with NonFiniteStop", ()),
        ("without", ("callbacks.nonfinite_stop=null",)),
        ("with an empty Callback instead", ("callbacks.nonfinite_stop._target_=lightning.pytorch.Callback",
                                            "~callbacks.nonfinite_stop.every_n_steps")),
    ]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    steps = 0
    for round_ in range(repeat + 1):
        for index, (name, extra) in enumerate(runs[round_ % 3 :] + runs[: round_ % 3]):
            overrides = (f"trainer.max_epochs={epochs}", *extra)
            trainer, model, data = build(_config(folder / f"{round_}-{index}", *overrides))
            start = time.perf_counter()
            trainer.fit(model, datamodule=data)
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - start)
            steps = trainer.global_step
    return times, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        step, batch, check = hooks(Path(folder), args.repeat)
        times, steps = fits(Path(folder), args.repeat, args.epochs)
    print("| measured | seconds | against |")
    print("| --- | --- | --- |")
    print(f"| bare training step of ema's module | {step * 1e6:.0f} us | |")
    print(f"| per batch (loss copied on the device) | {batch * 1e6:.1f} us | {batch / step:.2%} of a step |")
    print(f"| per check (losses and weights read) | {check * 1e6:.0f} us | {check / 50 / step:.2%} of a step over 50 |")
    for name, seconds in times.items():
        print(
            f"| ema fit, {args.epochs} epochs ({steps} steps), {name} | median {statistics.median(seconds):.3f} s, "
            f"fastest {min(seconds):.3f} s | {len(seconds)} fits |"
        )


if __name__ == "__main__":
    main()
