import pytest

from gradian.config import load_config, parse_override
from gradian.errors import ConfigError


def _write(tmp_path, text):
    p = tmp_path / "gradian.yaml"
    p.write_text(text)
    return p


BASE = "model:\n  base: m\ndata:\n  train: t.jsonl\n"


def test_unknown_key_names_the_key_path(tmp_path):
    p = _write(tmp_path, BASE + "grads:\n  projection_dims: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'grads.projection_dims'"):
        load_config(p)


def test_mistyped_value_names_the_key(tmp_path):
    p = _write(tmp_path, BASE + "grads:\n  batch_size: -3\n")
    with pytest.raises(ConfigError, match=r"grads.batch_size"):
        load_config(p)
    p = _write(tmp_path, BASE + "evaluation:\n  metric: accuracy\n")
    with pytest.raises(ConfigError, match=r"evaluation.metric"):
        load_config(p)


def test_missing_required_key(tmp_path):
    p = _write(tmp_path, "data:\n  train: t.jsonl\n")
    with pytest.raises(ConfigError, match=r"missing required key 'model'"):
        load_config(p)


def test_set_overrides_keep_yaml_types_and_validate(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = load_config(p, ["grads.batch_size=4", "grads.module_filter=[down_proj]", "evaluation.require_significant=false"])
    assert cfg.grads.batch_size == 4
    assert cfg.grads.module_filter == ["down_proj"]
    assert cfg.evaluation.require_significant is False
    with pytest.raises(ConfigError, match="grads.nope"):
        load_config(p, ["grads.nope=1"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override("grads.batch_size")


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = load_config(p)
    assert cfg.path(cfg.data.train) == tmp_path / "t.jsonl"
    assert cfg.output_dir == tmp_path / "gradian-out"


def test_invalid_yaml_names_the_line(tmp_path):
    p = _write(tmp_path, "model:\n  base: [unclosed\n")
    with pytest.raises(ConfigError, match=r"gradian.yaml:\d+: invalid YAML"):
        load_config(p)
