"""The Lightning internals the adapters go through (``copy_correct.lightning._lightning_internals``): each adapter
checks that what it needs is there before it uses it, and a Lightning without one stops before training, in one line
naming it and the version installed; an ``EMAWeights`` evaluation that Lightning does not run through the wrapped
``run`` stops instead of logging no EMA metrics. Each with its control: the Lightning installed runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

from copy_correct.lightning import AtomicModelParallelStrategy, EMAWeights, ResumeState, resume_data_order
from copy_correct.lightning import _lightning_internals as internals
from tests.lightning.test_ema_weights import Classifier, labelled, trainer


def refusal(who: str, missing: str) -> str:
    """The one line an adapter stops with where the Lightning installed lacks ``missing``."""
    return (
        f"{who} needs Lightning's {missing} (Lightning 2.6), which Lightning {pl.__version__} installed does not have: "
        "use lightning>=2.6.6,<2.7"
    )


def raises_one_line(expected: str) -> Any:
    return pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$")


def test_check_names_every_missing_internal_in_one_line_and_passes_when_all_are_there() -> None:
    there = internals.Internal("a", lambda owner: True)
    absent = [internals.Internal("b", lambda owner: False), internals.Internal("c", lambda owner: False)]
    with raises_one_line(refusal("Who", "b and c")):
        internals.check("Who", object(), [there, *absent])
    internals.check("Who", object(), [there])  # the control: nothing missing, nothing raised


def test_the_lightning_installed_has_every_internal_the_adapters_need(tmp_path: Path) -> None:
    t = trainer(tmp_path, [])
    for need in (internals.EVALUATION_RUN, internals.EVALUATION_END_METRICS, internals.RESULTS_TABLE,
                 internals.DATA_FETCHER, internals.BATCHES_FETCHED):  # fmt: skip
        assert need.present(t), need.name
    assert internals.DISTRIBUTED_CHECKPOINT.present(AtomicModelParallelStrategy())


def test_ema_both_without_log_eval_end_metrics_stops_at_setup_and_ema_alone_does_not_need_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(_LoggerConnector, "log_eval_end_metrics")  # a Lightning without it
    module = Classifier()
    before = {name: value.clone() for name, value in module.state_dict().items()}
    t = trainer(tmp_path, [EMAWeights(decay=0.9)])
    with raises_one_line(refusal("EMAWeights(evaluate='both')", "trainer._logger_connector.log_eval_end_metrics")):
        t.fit(module, labelled())
    assert t.global_step == 0 and all(torch.equal(before[k], v) for k, v in module.state_dict().items())

    for evaluate in ("ema", "live"):  # the control: these never call it, so they train (no validation to log)
        t = trainer(tmp_path, [EMAWeights(decay=0.9, evaluate=evaluate)], max_epochs=1)
        t.fit(Classifier(), labelled())
        assert t.global_step == 6


def run_stage_by_the_class(self: pl.Trainer) -> Any:
    """A Lightning whose trainer runs an evaluation by the loop's class, not through the loop instance."""
    if self.evaluating:
        loop = self._evaluation_loop
        return type(loop).run(loop)
    return run_stage(self)


run_stage = pl.Trainer._run_stage


@pytest.mark.parametrize("evaluate", ["both", "ema"])
def test_an_evaluation_lightning_runs_outside_the_wrapped_run_stops_instead_of_dropping_the_ema_metrics(
    evaluate: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pl.seed_everything(0)
    ema, module = EMAWeights(decay=0.9, evaluate=evaluate), Classifier()
    t = trainer(tmp_path, [ema], max_epochs=1)
    t.fit(module, labelled())
    (both,) = t.validate(module, labelled(48), verbose=False)  # the control: through the instance
    if evaluate == "both":
        assert {"val/acc", "val/acc_ema", "val/loss", "val/loss_ema"} == set(both)
        assert {"val/acc", "val/acc_ema"} <= set(t.callback_metrics)
    assert ema.ema is not None
    (average,) = trainer(tmp_path, []).validate(ema.ema.export(), labelled(48), verbose=False)
    assert both[f"val/loss{'_ema' if evaluate == 'both' else ''}"] == average["val/loss"]

    monkeypatch.setattr(pl.Trainer, "_run_stage", run_stage_by_the_class)
    with raises_one_line(refusal(f"EMAWeights(evaluate={evaluate!r})", internals.EVALUATION_DISPATCH)):
        t.validate(module, labelled(48), verbose=False)

    monkeypatch.setattr(EMAWeights, "_check_dispatched", lambda self: None)  # the control: without the check
    (live,) = t.validate(module, labelled(48), verbose=False)
    assert set(live) == {"val/acc", "val/loss"} and live["val/loss"] != average["val/loss"]  # silently the live model's


def test_resume_state_without_the_data_fetcher_stops_before_the_first_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = trainer(tmp_path, [ResumeState()], max_epochs=1)  # the control: the Lightning installed trains
    t.fit(Classifier(), labelled())
    assert t.global_step == 6

    absent = dataclasses.replace(internals.DATA_FETCHER, present=lambda trainer: False)  # a Lightning without it
    monkeypatch.setattr(resume_data_order, "NEEDS", (absent, internals.BATCHES_FETCHED))
    t = trainer(tmp_path, [ResumeState()], max_epochs=1)
    with raises_one_line(refusal("ResumeState", "Trainer.fit_loop._data_fetcher")):
        t.fit(Classifier(), labelled())
    assert t.global_step == 0


def test_the_atomic_strategy_without_save_distributed_checkpoint_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for distributed in (True, False):  # the control: it reads what it was given
        assert (
            internals.saves_distributed_checkpoint(AtomicModelParallelStrategy(save_distributed_checkpoint=distributed))
            is distributed
        )

    init = ModelParallelStrategy.__init__

    def without_the_flag(self: ModelParallelStrategy, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        del self._save_distributed_checkpoint

    monkeypatch.setattr(ModelParallelStrategy, "__init__", without_the_flag)  # a Lightning without it
    with raises_one_line(refusal("AtomicModelParallelStrategy", "ModelParallelStrategy._save_distributed_checkpoint")):
        AtomicModelParallelStrategy()
