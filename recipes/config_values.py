"""What each number and flag of the recipes' configuration takes, checked on the whole composed config before anything
is built (``recipes.build.build`` calls ``check_values`` first): a value of the wrong type (``data.batch_size=abc``,
``model.lr=fast``, ``seed=abc``, ``data.verify=yes``), a NaN or an infinity (``model.lr=inf``) or one out of range
(``model.tau=2``) is refused in one line that names the key and says what it takes, such as
``model.lr must be in (0, inf), got inf``; ``train.py`` prints it and exits with status 2.

``ALLOWED`` is the table: one entry per key of ``conf/`` that holds a number or a flag (a ``*`` stands for any one
part of a key), each with its type and range; ``tests/recipes/test_config_values.py`` walks every recipe's composed
config and fails on a number or flag it does not list. The ranges here are what a value can mean at all; the parts
that take the values refine them where they know more (``model.eval_samples`` >= 100 for the 10x10 grid,
``data.max_shift`` below ``data.size``, a ``data.val_fraction`` that leaves one digit of each class per split), and
a size that cannot be allocated is refused where it is allocated (``recipes.allocation``). A key a user adds
(``+model.foo=3``) is not checked here: the part that takes it checks it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

import copy_correct.core.checks as _checks
from copy_correct.decay_schedule import warmup_name

__all__ = [
    "ALLOWED",
    "Devices",
    "Flag",
    "Fraction",
    "Real",
    "Reals",
    "Sizes",
    "Warmup",
    "Whole",
    "check_values",
    "config_keys",
    "is_interpolation",
    "rule_for",
    "value_of",
]

SEED_MAX = 2**32 - 1  # numpy's and Lightning's seeds: pl.seed_everything refuses more


@dataclass(frozen=True)
class Whole:
    """An integer ``>= minimum`` (and ``<= maximum`` where given); ``null`` too where ``null`` says what it means;
    ``word`` a string Lightning also takes there (``trainer.devices=auto``)."""

    minimum: int
    maximum: int | None = None
    null: str | None = None
    word: str | None = None

    def check(self, key: str, value: Any) -> None:
        if (value is None and self.null) or (self.word is not None and value == self.word):
            return
        try:
            _checks.integer(key, value, self.minimum, self.maximum)
        except (TypeError, ValueError) as err:
            raise ValueError(_or(str(err), self.null, self.word)) from None

    def refused(self) -> list[str]:
        """Overrides (as typed after ``key=``) this rule refuses: the wrong type, a float, and just out of range."""
        below = [str(self.minimum - 1)]
        return ["abc", "1.5", "true", *below, *([str(self.maximum + 1)] if self.maximum is not None else [])]


@dataclass(frozen=True)
class Real:
    """A finite real number in ``interval`` (``"(0, inf)"``, ``"[0, 1)"``: the infinite end is open); ``null`` too
    where ``null`` says what it means."""

    interval: str
    null: str | None = None

    def check(self, key: str, value: Any) -> None:
        if value is None and self.null:
            return
        try:
            _checks.number(key, value, self.interval)
        except (TypeError, ValueError) as err:
            raise ValueError(_or(str(err), self.null, None)) from None

    def refused(self) -> list[str]:
        low, high = (float(bound) for bound in self.interval[1:-1].split(","))
        outside = [str(low) if self.interval[0] == "(" else str(low - 1)] if math.isfinite(low) else []
        outside += [str(high) if self.interval[-1] == ")" else str(high + 1)] if math.isfinite(high) else []
        return ["fast", "inf", "-inf", "nan", *outside]


@dataclass(frozen=True)
class Fraction:
    """Lightning's ``limit_*_batches``: a count of batches (an integer >= 0), a fraction of them (a float in [0, 1]), or
    null (all)."""

    def check(self, key: str, value: Any) -> None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return
        if isinstance(value, float) and 0.0 <= value <= 1.0:  # NaN fails both comparisons
            return
        raise ValueError(
            f"{key} must be a number of batches (an integer >= 0), a fraction of them (a float in [0, 1]) or null "
            f"(all), got {_checks.shown(value)}"
        )

    def refused(self) -> list[str]:
        return ["abc", "-1", "1.5", "nan", "inf"]


@dataclass(frozen=True)
class Devices:
    """Lightning's ``devices``: how many (an integer >= 1, or -1 for all), ``auto``, or which (a list of indices, or
    a string of them: ``"0,1"``)."""

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1):
            return
        if value == "auto" or (isinstance(value, str) and all(p.strip().isdigit() for p in value.split(","))):
            return
        if isinstance(value, list) and value and all(type(i) is int and i >= 0 for i in value):
            return
        raise ValueError(
            f"{key} must be a number of devices (an integer >= 1, or -1 for all), 'auto', or a list of device "
            f"indices, got {_checks.shown(value)}"
        )

    def refused(self) -> list[str]:
        return ["two", "0", "-2", "1.5", "inf", "[]", "[-1]"]


@dataclass(frozen=True)
class Flag:
    """``true`` or ``false``: ``yes`` and ``1`` are not flags."""

    def check(self, key: str, value: Any) -> None:
        try:
            _checks.flag(key, value)
        except TypeError as err:
            raise ValueError(str(err).replace("True or False", "true or false")) from None

    def refused(self) -> list[str]:
        return ["yes", "1", "null"]


@dataclass(frozen=True)
class Warmup:
    """An EMA's warm-up: ``true``, ``false`` or one of ``copy_correct.decay_schedule.WARMUPS`` (``ratio``, ...)."""

    def check(self, key: str, value: Any) -> None:
        try:
            warmup_name(value)
        except (TypeError, ValueError) as err:
            raise ValueError(str(err).replace("warmup", key, 1).replace("True, False", "true, false")) from None

    def refused(self) -> list[str]:
        return ["yes", "1", "null", "linear"]


@dataclass(frozen=True)
class Sizes:
    """A list of ``length`` integers >= 1 (``model.image_shape``: channels, height, width), or null (from the data)."""

    length: int
    null: str

    def check(self, key: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple)) and len(value) == self.length:
            try:
                for item in value:
                    _checks.integer(key, item, 1)
                return
            except (TypeError, ValueError):
                pass
        raise ValueError(
            f"{key} must be a list of {self.length} integers >= 1 or null ({self.null}), got {_checks.shown(value)}"
        )

    def refused(self) -> list[str]:
        return ["abc", "[1,8]", "[1,8,inf]", "[1,0,8]"]


@dataclass(frozen=True)
class Reals:
    """A non-empty list of finite real numbers in ``interval``."""

    interval: str

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, (list, tuple)) and value:
            try:
                for item in value:
                    _checks.number(key, item, self.interval)
                return
            except (TypeError, ValueError):
                pass
        raise ValueError(f"{key} must be a list of numbers in {self.interval}, got {_checks.shown(value)}")

    def refused(self) -> list[str]:
        return ["abc", "[]", "[0.05,nan]", "[0.05,inf]", "[0]"]


Rule = Whole | Real | Fraction | Devices | Flag | Sizes | Reals


def _or(message: str, null: str | None, word: str | None) -> str:
    """``message`` (``KEY must be ..., got X``) with what else the key takes put before ``, got``."""
    also = (f" or {word!r}" if word else "") + (f" or null ({null})" if null else "")
    head, sep, got = message.rpartition(", got ")
    return f"{head}{also}{sep}{got}" if sep else message


# Every number and flag of conf/, by full key. A recipe has only some of them; each is checked where it is present.
ALLOWED: dict[str, Rule] = {
    "seed": Whole(0, SEED_MAX),
    "*.seed": Whole(0, SEED_MAX),  # data.seed, model.seed, callbacks.*.seed: ${seed} unless set
    # trainer (conf/trainer/*.yaml): Lightning's Trainer arguments
    "trainer.max_epochs": Whole(-1, null="Lightning's default: 1000, or max_steps"),  # -1: no limit
    "trainer.max_steps": Whole(-1),  # -1: no limit
    "trainer.limit_train_batches": Fraction(),
    "trainer.limit_val_batches": Fraction(),
    "trainer.num_sanity_val_steps": Whole(-1),  # -1: the whole validation set
    "trainer.check_val_every_n_epoch": Whole(1, null="validate by steps only"),
    "trainer.accumulate_grad_batches": Whole(1),
    "trainer.gradient_clip_val": Real("[0, inf)", null="no clipping"),
    "trainer.log_every_n_steps": Whole(1),
    "trainer.devices": Devices(),
    "trainer.num_nodes": Whole(1),
    "trainer.strategy.data_parallel_size": Whole(1, word="auto"),
    "trainer.strategy.tensor_parallel_size": Whole(1, word="auto"),
    "trainer.strategy.save_distributed_checkpoint": Flag(),
    "trainer.enable_progress_bar": Flag(),
    "trainer.enable_model_summary": Flag(),
    "trainer.deterministic": Flag(),
    "trainer.sync_batchnorm": Flag(),
    # callbacks (conf/callbacks/default.yaml and the recipes')
    "callbacks.*.every_n_train_steps": Whole(0, null="not by steps"),  # 0: not by steps
    "callbacks.*.train_time_interval": Real("[0, inf)", null="not by time"),  # seconds
    "callbacks.*.save_top_k": Whole(-1),  # -1: every checkpoint
    "callbacks.*.save_last": Flag(),
    "callbacks.*.auto_insert_metric_name": Flag(),
    "callbacks.*.enabled": Flag(),
    "callbacks.*.every_n_steps": Whole(1),
    "callbacks.ema.decay": Real("[0, 1)"),
    "callbacks.ema.warmup": Warmup(),
    "callbacks.ema.update_bn": Flag(),
    "callbacks.posthoc_ema.sigma_rels": Reals("(0, 0.2887)"),
    "callbacks.posthoc_ema.snapshot_every": Whole(1),
    # data (conf/data/*.yaml, conf/recipe/metrics.yaml and pinned.yaml)
    "data.batch_size": Whole(1),
    "data.val_fraction": Real("(0, 1)"),
    "data.num_workers": Whole(0),
    "data.image_size": Whole(1, null="the files' own"),
    "data.channels": Whole(1, 3, null="the files' own"),  # 1 or 3: the data modules refuse 2
    "data.size": Whole(8),
    "data.max_shift": Whole(0),
    "data.store_size": Whole(1),
    "data.batches_per_epoch": Whole(1),
    "data.resize": Flag(),
    "data.convert": Flag(),
    "data.verify": Flag(),
    "data.prefetch": Flag(),
    # model (conf/recipe/*.yaml, conf/dqn/atari.yaml, conf/pinned/gpu_scale.yaml)
    "model.image_shape": Sizes(3, null="from the data"),
    "model.num_classes": Whole(1, null="from the data"),
    "model.lr": Real("(0, inf)"),
    "model.momentum": Real("[0, 1)"),
    "model.weight_decay": Real("[0, inf)"),
    "model.hidden": Whole(1),
    "model.width": Whole(1),
    "model.conv_width": Whole(1),
    "model.latent": Whole(1),
    "model.in_channels": Whole(1, 3),
    "model.stem_stride": Whole(1),
    "model.d_dropout": Real("[0, 1)"),
    "model.beta1": Real("[0, 1)"),
    "model.eval_samples": Whole(1),
    "model.judge_epochs": Whole(1),
    "model.gamma": Real("[0, 1]"),
    "model.n_steps": Whole(1),
    "model.tau": Real("(0, 1]"),
    "model.batch_size": Whole(1),
    "model.buffer_size": Whole(1),
    "model.learning_starts": Whole(0),
    "model.train_freq": Whole(1),
    "model.gradient_steps": Whole(1),
    "model.target_update_every": Whole(1),
    "model.exploration_fraction": Real("(0, 1]"),
    "model.exploration_final_eps": Real("[0, 1]"),
    "model.total_env_steps": Whole(1),
    "model.eval_every": Whole(1),
    "model.eval_episodes": Whole(1),
    "model.max_grad_norm": Real("(0, inf)", null="no clipping"),
    "model.prioritized": Flag(),
    "model.alpha": Real("[0, inf)"),
    "model.beta": Real("[0, 1]"),
    "model.priority_eps": Real("(0, inf)"),
}


def rule_for(key: str) -> Rule | None:
    """The rule of full key ``key``: its own entry, else the first pattern that matches it, else None."""
    if key in ALLOWED:
        return ALLOWED[key]
    patterns = (rule for pattern, rule in ALLOWED.items() if "*" in pattern and fnmatch.fnmatchcase(key, pattern))
    return next(patterns, None)


def config_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """The full key of every value below ``node`` that is not a mapping, in config order (a list is one value);
    nothing is resolved."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            yield from config_keys(child, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def value_of(cfg: DictConfig, key: str) -> Any:
    """The value at full key ``key``, resolved (``${seed}``); a list as a plain list."""
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value


def is_interpolation(cfg: DictConfig, key: str) -> bool:
    """Whether full key ``key`` holds an interpolation (``${seed}``) rather than a value of its own."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return OmegaConf.is_interpolation(node, last)


def check_values(cfg: DictConfig) -> None:
    """``ValueError`` of one line naming the first key whose value its rule in ``ALLOWED`` refuses: the key, what it
    takes, and what was given. Keys with values of their own come first, in config order, then the ones that copy
    another's (``callbacks.last_checkpoint.every_n_train_steps: ${model.gradient_steps}``), so that the line names
    the key that was given. Only the keys with a rule are resolved."""
    keys = [key for key in config_keys(cfg) if rule_for(key) is not None]
    for key in sorted(keys, key=lambda key: is_interpolation(cfg, key)):  # stable: config order within each
        rule = rule_for(key)
        assert rule is not None
        rule.check(key, value_of(cfg, key))
