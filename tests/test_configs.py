"""Every shipped config file is valid and round-trips through the resolved-config writer."""

import tomllib
from pathlib import Path

import pytest

from dptrain.config import config_from_dict, config_to_toml, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_configs_are_shipped():
    assert {p.name for p in CONFIGS} >= {"default.toml", "cnn28_quick.toml", "digits.toml", "synthetic.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_and_round_trips(path):
    cfg = load_config(path)
    assert config_from_dict(tomllib.loads(config_to_toml(cfg))) == cfg
