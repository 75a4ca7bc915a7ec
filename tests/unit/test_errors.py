"""amp_recipes.errors.one_sentence_errors: what a recipe's `__main__` turns into `error: ...`."""

import pytest

from amp_recipes.errors import InputError, first_to_say, lost_rank_message, one_sentence_errors

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


# ----------------------------------------------------------------------------- first_to_say
def test_a_sentence_is_said_once_per_launch_through_torchruns_store(monkeypatch):
    """Two ranks of a torchrun launch reach the same sentence: the first prints it, the second does
    not; another sentence, or a restarted launch, is printed again. A real TCPStore plays the one
    torchrun's agent holds (tests/recipes/test_bad_input.py runs the real launch)."""
    from datetime import timedelta

    import torch.distributed as dist
    from conftest import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))  # noqa: F841
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    assert first_to_say("error: no model") is True  # rank 0
    assert first_to_say("error: no model") is False  # rank 1: the same sentence
    assert first_to_say("error: rank 1's own cause") is True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert first_to_say("error: no model") is True


def test_without_torchruns_store_every_sentence_is_said(monkeypatch):
    """One process, another launcher, or a store that does not answer: printed, never lost."""
    from conftest import free_port

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert first_to_say("error: x") is True and first_to_say("error: x") is True
    # torchrun's variables, but nothing listens on the port: the 5 s timeout, then printed.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert first_to_say("error: x") is True


def test_a_head_of_another_size_under_zero3_init_names_the_config_setting(monkeypatch):
    """Under ZeRO-3's zero.Init transformers loads into partitioned weights and ignores
    --ignore_mismatched_sizes (transformers 5.24 raises its size-mismatch error all the same): the
    sentence must not tell the user to pass the flag they passed."""
    import transformers.integrations

    from amp_recipes.errors import model_load_errors

    mismatch = RuntimeError(
        "Error(s) in loading state_dict for BertForTokenClassification: size mismatch for classifier.weight "
        "... You may consider adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if appropriate."
    )
    for zero3, expected in [(False, "pass --ignore_mismatched_sizes"), (True, "set zero3_init_flag: false")]:
        monkeypatch.setattr(
            transformers.integrations, "is_deepspeed_zero3_enabled", lambda zero3=zero3: zero3
        )
        with pytest.raises(InputError, match=expected) as raised, model_load_errors("bert-base-uncased", 9):
            raise mismatch
        assert "9 output(s)" in str(raised.value)
