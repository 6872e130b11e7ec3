"""TrainConfig: defaults, validation errors naming the field, TOML loading, unknown keys."""

from __future__ import annotations

import pytest

from qkv.train import TrainConfig


def test_defaults_are_valid_and_round_trip():
    config = TrainConfig()
    assert config.batch_size == 32 and TrainConfig(batch_tokens=500).batch_size is None
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.metric_mode == "min"
    assert TrainConfig(metric="bleu").metric_mode == "max"


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        TrainConfig(100)  # type: ignore[misc]
    config = TrainConfig()
    with pytest.raises(AttributeError):
        config.steps = 5  # type: ignore[misc]
    assert config.replace(steps=5).steps == 5


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps must be an int >= 1, got 0"),
    (dict(steps=2.0), "steps must be an int >= 1, got 2.0"),
    (dict(batch_size=8, batch_tokens=100), "give batch_size or batch_tokens, not both"),
    (dict(batch_size=0), "batch_size must be an int >= 1 or None, got 0"),
    (dict(lr=0.0), "lr must be a finite number > 0, got 0.0"),
    (dict(lr=float("nan")), "lr must be a finite number > 0, got nan"),
    (dict(schedule="linear"), "schedule must be one of \\('inverse_sqrt', 'cosine', 'constant'\\), got 'linear'"),
    (dict(schedule="inverse_sqrt", warmup=0), "warmup must be >= 1 for schedule 'inverse_sqrt', got 0"),
    (dict(warmup=-1), "warmup must be an int >= 0, got -1"),
    (dict(label_smoothing=1.0), "label_smoothing must be a finite number in \\[0, 1\\), got 1.0"),
    (dict(clip=0.0), "clip must be a finite number > 0 or None, got 0.0"),
    (dict(accumulate=0), "accumulate must be an int >= 1, got 0"),
    (dict(patience=0), "patience must be an int >= 1 or None, got 0"),
    (dict(metric="f1"), "metric must be one of .*, got 'f1'"),
    (dict(betas=(0.9,)), "betas must be two numbers in \\[0, 1\\), got \\(0.9,\\)"),
    (dict(betas=(0.9, 1.0)), "betas must be two numbers in \\[0, 1\\)"),
    (dict(bf16=1), "bf16 must be a bool, got 1"),
    (dict(seed="0"), "seed must be an int, got '0'"),
    (dict(device=""), "device must be a non-empty str"),
    (dict(min_lr_ratio=2.0), "min_lr_ratio must be a finite number in \\[0, 1\\], got 2.0"),
])  # fmt: skip
def test_validation_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_from_toml(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text(
        'steps = 50\nbatch_size = 8\nlr = 3e-4\nschedule = "cosine"\nwarmup = 5\n'
        'betas = [0.9, 0.95]\nrun_dir = "runs/x"\nclip = 0.5\n'
    )
    config = TrainConfig.from_toml(path)
    assert (config.steps, config.batch_size, config.lr, config.schedule) == (50, 8, 3e-4, "cosine")
    assert config.betas == (0.9, 0.95) and config.run_dir == "runs/x" and config.clip == 0.5
    assert TrainConfig.from_toml(path, steps=7).steps == 7


def test_from_toml_unknown_key_names_it(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text("steps = 5\nlearning_rate = 0.1\n")
    with pytest.raises(ValueError, match=r"train.toml: unknown TrainConfig key\(s\) \['learning_rate'\]"):
        TrainConfig.from_toml(path)


def test_from_toml_bad_value_and_bad_syntax_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("steps = -3\n")
    with pytest.raises(ValueError, match=r"bad.toml: steps must be an int >= 1, got -3"):
        TrainConfig.from_toml(path)
    path.write_text("steps = = 3\n")
    with pytest.raises(ValueError, match=r"bad.toml is not valid TOML"):
        TrainConfig.from_toml(path)
    with pytest.raises(FileNotFoundError, match=r"no TrainConfig TOML file at"):
        TrainConfig.from_toml(tmp_path / "missing.toml")


def test_a_step_count_no_run_could_finish_is_refused():
    """Issue 31: ``qkv train --steps 10**30`` ran with no end in sight."""
    with pytest.raises(ValueError, match=r"steps must be at most 1,000,000,000"):
        TrainConfig(steps=10**30)
    assert TrainConfig(steps=10**9).steps == 10**9
