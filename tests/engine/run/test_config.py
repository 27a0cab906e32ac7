import json

import pytest
from multilane.engine.config import RunConfig, build_config, load_config, save_config
from multilane.engine.errors import UserError


def test_defaults_are_the_first_launch_run():
    c = RunConfig()
    assert (c.task.name, c.devices.use, c.optim.name) == ("digits", "auto", "adam")


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_save_and_load_round_trip(tmp_path, suffix):
    c = build_config({"optim": {"lr": 0.01, "name": "sgd"}, "train": {"steps": 12}, "task": {"params": {"hidden": 9}}})
    path = tmp_path / f"preset{suffix}"
    save_config(c, path)
    assert load_config(path) == c


@pytest.mark.parametrize(
    "data,words",
    [
        ({"optim": {"lr": -1}}, "optim.lr = -1: Input should be greater than 0"),
        ({"optim": {"lr": "fast"}}, 'optim.lr = "fast": Input should be a valid number'),
        ({"optim": {"name": "lbfgs"}}, "optim.name = \"lbfgs\": Input should be 'sgd', 'adam' or 'adamw'"),
        ({"data": {"batch_size": 0}}, "data.batch_size = 0: Input should be greater than or equal to 1"),
        ({"train": {"epochs": 5, "stepz": 3}}, "train.stepz: unknown key; did you mean train.steps?"),
        ({"telemetry": {"record": 1}}, "telemetry.record: unknown key; did you mean telemetry.record_s?"),
        ({"telemtry": {}}, "telemtry: unknown key; did you mean telemetry?"),
        ({"colour": "red"}, "colour: unknown key"),
        ({"devices": {"weights": [0, 0]}}, "weights must be >= 0 and not all 0"),
        ({"optim": {"name": "sgd", "momentum": 0, "nesterov": True}}, "nesterov needs momentum > 0"),
        ({"optim": 3}, "optim = 3"),
    ],
)
def test_an_invalid_value_names_the_key_the_value_and_the_rule(data, words):
    with pytest.raises(UserError) as info:
        build_config(data)
    assert words in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name,text,words",
    [
        ("empty.toml", "  \n", "the file is empty"),
        ("broken.toml", "[optim\nlr = 1", "not valid TOML"),
        ("broken.json", '{"optim": ', "not valid JSON"),
        ("list.json", "[1, 2]", "expected a table of sections"),
        ("conf.yaml", "optim: {}", "unknown config format"),
    ],
)
def test_broken_files_get_one_clear_line(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=words):
        load_config(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(UserError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


def test_every_field_has_a_description_for_tooltips():
    missing = []
    for section_name, section in RunConfig.model_fields.items():
        for field_name, field in section.annotation.model_fields.items():
            if not field.description:
                missing.append(f"{section_name}.{field_name}")
    assert missing == []


def test_the_saved_json_is_what_the_run_directory_holds(tmp_path):
    c = RunConfig()
    save_config(c, tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text()) == c.to_dict()
