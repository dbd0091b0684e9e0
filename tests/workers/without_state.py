"""Controls for the resume tests that run in other processes, where a test cannot patch: a piece of the saved state
withheld by a class that ignores it."""

from __future__ import annotations

from typing import Any

from copy_correct.lightning import EMAWeights


class EMAWeightsWithoutState(EMAWeights):
    """Resumes with a fresh average: finds its state under ``EMAWeights``'s key, and ignores it."""

    @property
    def state_key(self) -> str:
        return self._generate_state_key(decay=self._ema_kwargs["decay"]).replace(type(self).__qualname__, "EMAWeights")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
