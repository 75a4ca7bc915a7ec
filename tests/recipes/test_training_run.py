"""amp_recipes.training.run.TrainingRun: every way out of a recipe's run (finished, evaluation only, preempted,
failed) goes through its one exit path: the lock is released, the signal handlers and hooks go,
and the trackers end only for a run that finished or stopped on a signal."""

import signal

import pytest
from conftest import glue_flags, stop_at, train

from amp_recipes.training import checkpoint, outputs
from amp_recipes.training.run import TrainingRun

TINY = {"max_train_samples": 32, "logging_steps": 1}


@pytest.fixture
def ended(monkeypatch):
    """The runs whose trackers were ended (accelerator.end_training calls)."""
    calls = []
    real = TrainingRun.__exit__

    def recording(self, *exc):
        real(self, *exc)
        calls.append(self.ended)

    monkeypatch.setattr(TrainingRun, "__exit__", recording)
    return calls


def released(output_dir) -> bool:
    return not (output_dir / outputs.LOCK).exists() and not outputs._held


def test_a_run_that_fails_mid_training_releases_everything(recipe, tmp_path, monkeypatch, ended):
    before = signal.getsignal(signal.SIGTERM)

    def failing(*args, **kwargs):
        assert signal.getsignal(signal.SIGTERM) is not before  # the run's handler is in place
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(recipe, "evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(recipe, glue_flags(**TINY, eval_steps=2, output_dir=tmp_path / "out"))
    assert signal.getsignal(signal.SIGTERM) is before
    assert released(tmp_path / "out") and ended == [False]  # W&B marks a crashed run itself


def test_finished_eval_only_and_preempted_runs_release_and_end(recipe, tmp_path, monkeypatch, ended):
    before = signal.getsignal(signal.SIGTERM)
    train(recipe, glue_flags(**TINY, output_dir=tmp_path / "done"))
    train(
        recipe, glue_flags(eval_only=True, model_name_or_path=tmp_path / "done", output_dir=tmp_path / "eval")
    )
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(2))
    with pytest.raises(SystemExit) as stopped:
        train(recipe, glue_flags(**TINY, output_dir=tmp_path / "stopped"))
    assert stopped.value.code == 143
    assert (tmp_path / "stopped" / "checkpoints" / "checkpoint-2" / checkpoint.MARKER).is_file()
    assert ended == [True, True, True]
    assert all(released(tmp_path / name) for name in ("done", "eval", "stopped"))
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_input_after_the_claim_removes_the_folder_it_created(recipe, tmp_path, ended):
    with pytest.raises(Exception, match="missing.csv"):
        train(
            recipe,
            glue_flags(
                task_name=None,
                data_dir=None,
                train_file=tmp_path / "missing.csv",
                validation_file=tmp_path / "missing.csv",
                output_dir=tmp_path / "new",
            ),
        )
    assert not (tmp_path / "new").exists() and ended == [False]


def test_a_run_that_lost_a_rank_keeps_its_sigterm_handler_until_the_error_is_printed(
    recipe, tmp_path, monkeypatch, ended
):
    """The launcher SIGTERMs every process once one died; arriving after the run's exit path and
    before one_sentence_errors prints, the default handler would end the process without a word."""
    import torch.distributed as dist

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

    def peer_died(*args, **kwargs):  # what gloo raises in rank 0 of 2 once rank 1 is gone
        for name, value in {"is_initialized": True, "get_rank": 0, "get_world_size": 2}.items():
            monkeypatch.setattr(dist, name, lambda value=value: value)
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:21634: Connection reset by peer")

    monkeypatch.setattr(recipe, "evaluate", peer_died)
    try:
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            train(recipe, glue_flags(**TINY, eval_steps=2, output_dir=tmp_path / "out"))
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        signal.raise_signal(signal.SIGTERM)  # the launcher's: noted, not fatal
        assert released(tmp_path / "out") and ended == [False]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
