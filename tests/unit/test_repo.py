"""The repository's docs and configs match the code."""

import re

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import RECIPES, REPO, load_recipe


def recipe_parser_flags(name):
    parser = load_recipe(name).build_parser()
    return {option for action in parser._actions for option in action.option_strings if option != "--help"}


@pytest.mark.parametrize("recipe", ["bert_glue", "bert_mlm"])
def test_every_recipe_flag_is_in_the_readme(recipe):
    readme = (REPO / "README.md").read_text()
    documented = set(re.findall(r"`(--[a-z0-9_]+)`", readme))
    flags = recipe_parser_flags(recipe)
    assert len(flags) > 20
    missing = flags - documented - {"-h"}
    assert not missing, f"flags of {recipe} missing from README.md: {sorted(missing)}"


def test_recipes_open_with_their_command():
    for recipe in RECIPES.glob("[!_]*.py"):
        first_lines = recipe.read_text().split('"""')[1]
        assert f"recipes/{recipe.name}" in first_lines, recipe


@pytest.mark.parametrize("config", sorted((REPO / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load_and_open_with_their_command(config):
    loaded = load_config_from_file(str(config))
    assert loaded.mixed_precision in ("no", "fp16", "bf16")
    assert config.read_text().startswith(
        f"# accelerate launch --config_file accelerate_configs/{config.name}"
    )


def test_engine_configs_carry_the_precision_settings_the_readme_promises():
    configs = {p.stem: load_config_from_file(str(p)) for p in (REPO / "accelerate_configs").glob("*.yaml")}
    assert configs["single_gpu"].mixed_precision == configs["multi_gpu"].mixed_precision == "fp16"
    fsdp = configs["fsdp"]
    assert fsdp.distributed_type == "FSDP" and fsdp.mixed_precision == "fp16"
    assert fsdp.fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD"
    for stage in (2, 3):
        deepspeed = configs[f"deepspeed_zero{stage}"]
        assert deepspeed.distributed_type == "DEEPSPEED" and deepspeed.mixed_precision == "fp16"
        assert deepspeed.deepspeed_config["zero_stage"] == stage
        assert deepspeed.deepspeed_config["gradient_clipping"] == 1.0  # DeepSpeed clips, not the recipe
    assert configs["deepspeed_zero3"].deepspeed_config["zero3_save_16bit_model"] is True
    node = configs["multi_node"]
    assert (node.num_machines, node.num_processes, node.rdzv_backend) == (2, 16, "static")
    readme = (REPO / "README.md").read_text()
    assert all(f"`{name}.yaml`" in readme for name in configs)
