from pathlib import Path

import pytest
import torch
from multilane.engine.errors import UserError
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import BUILTIN_TASKS, load_task_file, make_task

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_task.py"


def test_builtin_tasks_declare_typed_params_with_descriptions():
    for name, cls in BUILTIN_TASKS.items():
        for field_name, field in cls.Params.model_fields.items():
            assert field.description, f"{name}.{field_name}"


@pytest.mark.slow
def test_digits_is_the_real_sklearn_dataset_read_without_importing_sklearn():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    data = make_task("digits").data()
    assert len(data) == 1797 and data.inputs.shape == (1797, 1, 8, 8)
    assert data.inputs.min() >= 0.0 and data.inputs.max() <= 1.0
    d = load_digits()  # scikit-learn's own loader: the same images and labels, in the same order
    assert torch.equal(data.inputs, torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(data.target, torch.tensor(d.target, dtype=torch.long))
    # and the run's process never pays for importing scikit-learn and SciPy
    code = "import sys; from multilane.engine.tasks import make_task; make_task('digits').data(); print('sklearn' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_task_params_are_validated_with_the_key_named():
    with pytest.raises(UserError, match=r"task.params.hidden = -3"):
        make_task("digits", {"hidden": -3})
    with pytest.raises(UserError, match=r"task.params.colour: unknown key"):
        make_task("digits", {"colour": 1})


def test_the_documented_example_task_trains(make_config):
    cfg = make_config(task__name=str(EXAMPLE), train__steps=150, train__log_every=50, train__eval_every=150)
    result = Trainer(cfg).run()
    assert result.status == "finished"
    assert result.last_eval["metrics"]["mae"] < 0.2


@pytest.mark.parametrize(
    "source,words",
    [
        ("def broken(:\n", "syntax error at line 1"),
        ("import not_a_module_anywhere\n", "ModuleNotFoundError while importing it (line 1)"),
        ("x = 1\n", "defines no task"),
        ("TASK = 3\n", "TASK must be a subclass"),
        (
            "from multilane.engine.tasks.builtin import LinearTask\n"
            "class A(LinearTask):\n    pass\nclass B(LinearTask):\n    pass\n",
            "defines several tasks (A, B)",
        ),
    ],
)
def test_a_bad_task_file_gets_one_clear_line(tmp_path, source, words):
    path = tmp_path / "task.py"
    path.write_text(source)
    with pytest.raises(UserError) as info:
        load_task_file(path)
    assert words in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_task_file_is_named(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_task_file(tmp_path / "missing.py")
