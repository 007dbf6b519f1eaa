"""Configuration: errors name the field and value; the documented defaults file stays in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipeline.config import defaults_yaml, load_config
from dflash_pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_config_errors_name_field_and_value():
    with pytest.raises(ConfigError, match=r"extract.token_budget.*got -3"):
        load_config(None, ["extract.token_budget=-3"])
    with pytest.raises(ConfigError, match=r"data.nonsense"):
        load_config(None, ["data.nonsense=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["data.max_samples"])


def test_layer_ids_without_the_explicit_preset_are_refused_not_ignored():
    # a preset chooses its own layers: the ids were silently unused (and recorded in the store's run_config)
    for preset in ("dflash", "eagle3"):
        with pytest.raises(ConfigError, match=rf"layers.ids=\[1, 50\].*now '{preset}'.*add layers.preset=explicit"):
            load_config(None, [f"layers.preset={preset}", "layers.ids=[1,50]"])
    assert load_config(None, ["layers.preset=explicit", "layers.ids=[1,50]"]).layers.ids == [1, 50]


def test_a_bare_off_is_the_word_not_a_boolean(tmp_path):
    # YAML 1.1 reads off as False: `--set extract.compile=off` and `compile: off` in a file must mean 'off'
    cfg = load_config(None, ["extract.compile=off", "evaluate.baseline=off", "train.compile=off"])
    assert (cfg.extract.compile, cfg.evaluate.baseline, cfg.train.compile) == ("off", "off", "off")
    f = tmp_path / "c.yaml"
    f.write_text("extract:\n  compile: off\n")
    assert load_config(f, []).extract.compile == "off"
    # a field that offers no 'off' still refuses a boolean, naming it
    with pytest.raises(ConfigError, match=r"evaluate.baseline.*got True"):
        load_config(None, ["evaluate.baseline=on"])
    with pytest.raises(ConfigError, match=r"data.max_samples"):
        load_config(None, ["data.max_samples=off"])


def test_yaml_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  max_samples: 7\nlayers:\n  preset: explicit\n  ids: [1, 2]\n")
    cfg = load_config(f, ["data.max_samples=9", "extract.devices=cpu"])
    assert cfg.data.max_samples == 9 and cfg.layers.ids == [1, 2] and cfg.extract.devices == "cpu"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_committed_defaults_file_is_current():
    assert (ROOT / "configs" / "default.yaml").read_text() == defaults_yaml(), (
        "regenerate it: dflash-pipeline show-config > configs/default.yaml"
    )
    assert load_config(ROOT / "configs" / "default.yaml") == load_config()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.max_sample=3"], "data.max_sample: unknown key (--set); did you mean data.max_samples?"),
        (["dat.source=x.jsonl"], "dat.source: unknown key (--set); did you mean data.source?"),
        (["max_samples=3"], "did you mean data.max_samples?"),  # the right key in another section
        (["validate.sed=1"], "did you mean validate.seed?"),  # a section under its alias
        ({"layers.num_draft_layer": 3}, "(overrides); did you mean layers.num_draft_layers?"),  # the flow's
        (["data.zzzzqq=1"], "no such setting (every setting: dflash-pipeline show-config)"),
    ],
)
def test_unknown_keys_say_did_you_mean_on_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value) and "\n" not in str(e.value) and "Extra inputs" not in str(e.value)


def test_a_yaml_typo_names_the_file_and_the_closest_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  sorce: x.jsonl\ntrain:\n  epoch: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert f"data.sorce: unknown key (in {f}); did you mean data.source?" in msg, msg
    assert "train.epoch: unknown key" in msg and "did you mean train.epochs?" in msg and "\n" not in msg


def test_several_errors_of_one_field_are_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["extract.token_budget=-3"])
    assert str(e.value) == (
        "invalid configuration: extract.token_budget: Input should be greater than or equal to 16 or "
        "Input should be 'auto' (got -3)"
    )


@pytest.mark.parametrize(
    "key",
    [
        "output_dir",
        "store_path",
        "data.source",
        "target.model_path",
        "target.tokenizer_path",
        "train.output_dir",
        "evaluate.prompts",
    ],
)
def test_an_empty_path_setting_is_an_error_not_the_current_directory(key, tmp_path):
    # `--set output_dir=` ran the whole pipeline into the current directory (the source tree), exit 0
    with pytest.raises(ConfigError, match=rf"^{key} is empty \(''\): give "):
        load_config(None, [f"{key}="])
    for value in ("", "  "):  # the same from a config file (and a deployment's overrides: load_config too)
        f = tmp_path / "c.yaml"
        f.write_text(f"{key}: '{value}'\n" if "." not in key else "{}: {{{}: '{}'}}\n".format(*key.split("."), value))
        with pytest.raises(ConfigError, match=rf"^{key} is empty \('{value}'\)"):
            load_config(f)
