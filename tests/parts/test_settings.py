"""``copy_correct.averages.settings``: each argument of ``EMA`` and ``PowerEMA`` and its default are written once, in
the class's signature; the checks read the arguments by name, so a check and a signature cannot drift apart unseen.
The controls: an argument added to a signature alone is found unread, and a name a check reads that the signature
lacks fails on the first average built."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from copy_correct import EMA, PowerEMA
from copy_correct.averages.settings import defaults, ema_settings, power_ema_settings

CHECKS: dict[str, tuple[type, Callable[[Any], Any]]] = {
    "EMA": (EMA, ema_settings),
    "PowerEMA": (PowerEMA, power_ema_settings),
}


class Reads(dict):
    """A mapping of arguments that notes each name read from it."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__(arguments)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return super().__getitem__(name)


def unread(check: Callable[[Any], Any], arguments: dict[str, Any]) -> set[str]:
    """The names of ``arguments`` that ``check`` does not read."""
    given = Reads(arguments)
    check(given)
    return set(arguments) - given.read


@pytest.mark.parametrize("kind", CHECKS)
def test_every_argument_of_the_signature_is_read_by_its_check(kind: str) -> None:
    average, check = CHECKS[kind]
    arguments = defaults(average)
    assert list(arguments) == list(inspect.signature(average).parameters)[1:]  # all but the model, in order
    assert unread(check, arguments) == set()
    # The control: an argument added to the signature and not to the check is named.
    assert unread(check, arguments | {"added": 1}) == {"added"}


@pytest.mark.parametrize("kind", CHECKS)
def test_a_name_the_check_reads_and_the_signature_lacks_fails_at_once(kind: str) -> None:
    average, check = CHECKS[kind]
    renamed = dict(defaults(average))
    renamed["renamed"] = renamed.pop("include_buffers")
    with pytest.raises(KeyError, match="include_buffers"):
        check(renamed)
