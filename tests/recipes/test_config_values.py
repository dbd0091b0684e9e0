"""Every number and flag of every recipe's config is checked before anything is built (``recipes.config_values``):
each value its rule refuses (the wrong type, NaN, an infinity, out of range), typed as a user types it on the command
line, stops ``build`` with one line that starts with the key. The table covers the configs: a number or flag with no
rule fails here. The controls: every default passes, and the parts' own checks, which the table comes before, take
``lr=inf`` (``lr > 0`` holds for it) and say nothing naming the key for ``batch_size="abc"``."""

from __future__ import annotations

import copy
import fnmatch
import math
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from copy_correct.core.checks import shown
from recipes.build import build
from recipes.config_values import ALLOWED, check_values, config_keys, rule_for, value_of
from tests.conftest import compose_config

# Every config a user composes from conf/: each recipe, each data option, the add-on files, each trainer and logger.
VARIANTS = [
    ("metrics",), ("ema",), ("ema", "data=images", "data.root=/nowhere"), ("gan",), ("gan", "data=images",
    "data.root=/nowhere"), ("dqn",), ("dqn", "+dqn=atari"), ("pinned",), ("pinned", "+pinned=gpu_scale"),
    ("ema", "trainer=ddp"), ("ema", "trainer=fsdp"), ("ema", "trainer=gpu", "logger=tensorboard"),
]  # fmt: skip
# null here means no checkpoint, no data, no metric, frames kept as they are
NOT_NUMBERS = ("ckpt_path", "data", "callbacks.*.monitor", "model.compress")
PARSER = OverridesParser.create()


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], DictConfig]:
    out = tmp_path_factory.mktemp("out")
    return {v: compose_config(f"+recipe={v[0]}", *v[1:], output_dir=out) for v in VARIANTS}


def is_number_or_flag(key: str, value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and all(isinstance(item, (int, float)) for item in value)
    if value is None:
        return not any(fnmatch.fnmatchcase(key, pattern) for pattern in NOT_NUMBERS)
    return isinstance(value, (int, float, bool))


def test_every_number_and_flag_of_every_config_has_a_rule_and_its_default_passes(
    configs: dict[tuple[str, ...], DictConfig],
) -> None:
    uncovered, used = [], set()
    for variant, cfg in configs.items():
        check_values(cfg)  # the control: every default is taken
        for key in config_keys(cfg):
            if is_number_or_flag(key, value_of(cfg, key)):
                rule = rule_for(key)
                if rule is None:
                    uncovered.append(f"{' '.join(variant)}: {key}")
                used.add(next(p for p in ALLOWED if p == key or fnmatch.fnmatchcase(key, p)) if rule else None)
    assert not uncovered, f"numbers or flags without a rule in recipes/config_values.py: {uncovered}"
    assert used - {None} == set(ALLOWED)  # the table is what the configs hold: no rule for a key they do not have


def cases() -> list[tuple[str, tuple[str, ...]]]:
    """(key, the first variant that has it) for every key with a rule in any config."""
    found: dict[str, tuple[str, ...]] = {}
    out = Path("/nonexistent")
    for variant in VARIANTS:
        cfg = compose_config(f"+recipe={variant[0]}", *variant[1:], output_dir=out)
        for key in config_keys(cfg):
            if rule_for(key) is not None and not isinstance(value_of(cfg, key), str):
                found.setdefault(key, variant)
    return sorted(found.items())


@pytest.mark.parametrize(("key", "variant"), cases(), ids=[k for k, _ in cases()])
def test_each_value_a_rule_refuses_stops_naming_the_key(
    key: str, variant: tuple[str, ...], configs: dict[tuple[str, ...], DictConfig]
) -> None:
    cfg, rule = configs[variant], rule_for(key)
    assert rule is not None
    for typed in rule.refused():
        (override,) = PARSER.parse_overrides([f"{key}={typed}"])  # what Hydra makes of it: inf, nan, 'abc', [..]
        bad = copy.deepcopy(cfg)
        OmegaConf.update(bad, key, override.value(), force_add=True)
        with pytest.raises(ValueError) as refused:
            check_values(bad)
        line = str(refused.value)
        assert line.startswith(f"{key} must be") and "\n" not in line, (typed, line)
        value, (_, got, given) = override.value(), line.rpartition(", got ")
        assert got and given in {repr(value), str(value), shown(value)}, (typed, line)  # what was given, shown


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("model.lr=inf", "model.lr must be in (0, inf), got inf"),
        ("model.lr=nan", "model.lr must be in (0, inf), got nan"),
        ("model.lr=fast", "model.lr must be a number in (0, inf), got str 'fast'"),
        ("data.batch_size=abc", "data.batch_size must be an integer >= 1, got str 'abc'"),
        ("data.batch_size=64.0", "data.batch_size must be an integer >= 1, got float 64.0"),
        ("seed=abc", "seed must be an integer in [0, 4294967295], got str 'abc'"),
        ("seed=-1", "seed must be in [0, 4294967295], got -1"),
        ("trainer.gradient_clip_val=inf", "trainer.gradient_clip_val must be in [0, inf) or null (no clipping), got i"),
        ("trainer.gradient_clip_val=x", "trainer.gradient_clip_val must be a number in [0, inf) or null (no clip"),
        ("trainer.limit_val_batches=1.5", "trainer.limit_val_batches must be a number of batches (an integer >= 0)"),
        ("trainer.devices=two", "trainer.devices must be a number of devices (an integer >= 1, or -1 for all), 'aut"),
        ("trainer.enable_progress_bar=yes", "trainer.enable_progress_bar must be true or false, got str 'yes'"),
        ("callbacks.ema.decay=nan", "callbacks.ema.decay must be in [0, 1), got nan"),
        ("model.image_shape=[1,8,inf]", "model.image_shape must be a list of 3 integers >= 1 or null (from the dat"),
    ],
)
def test_the_lines_read_as_the_key_what_it_takes_and_what_was_given(override: str, line: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        build(compose_config("+recipe=ema", override, output_dir=tmp_path))
    assert str(refused.value).startswith(line), str(refused.value)


def test_the_parts_own_checks_take_inf_and_name_no_key_for_a_string() -> None:
    """The controls: what the table's check comes before. A model built from ``lr=inf`` is built (``lr > 0``), and
    a data module given ``batch_size="abc"`` fails comparing a string with an int, naming nothing."""
    from recipes.data.digits import DigitsDataModule
    from recipes.metrics import DigitsClassifier

    assert DigitsClassifier(lr=math.inf).hparams.lr == math.inf
    with pytest.raises(TypeError, match="'<' not supported between instances of 'str' and 'int'"):
        DigitsDataModule(batch_size="abc")
