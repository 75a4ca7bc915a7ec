"""amp_recipes.errors.one_sentence_errors: what a recipe's `__main__` turns into `error: ...`."""

import pytest

from amp_recipes.errors import InputError, lost_rank_message, one_sentence_errors

GLOO_TIMEOUT = "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"


def test_bad_input_becomes_one_sentence():
    with pytest.raises(SystemExit) as stop, one_sentence_errors():
        raise InputError("--seed must be at least 0.")
    assert stop.value.code == "error: --seed must be at least 0."


def test_other_errors_keep_their_traceback():
    with pytest.raises(RuntimeError, match="CUDA out of memory"), one_sentence_errors():
        raise RuntimeError("CUDA out of memory")


def test_a_timeout_outside_a_process_group_is_not_blamed_on_a_rank():
    # Only a collective of an initialised process group names ranks (tests/recipes/test_scale_out.py
    # runs the real ones: a killed rank, a stopped rank).
    assert lost_rank_message(RuntimeError(GLOO_TIMEOUT)) is None
    with pytest.raises(RuntimeError, match="Timed out waiting"), one_sentence_errors():
        raise RuntimeError(GLOO_TIMEOUT)
