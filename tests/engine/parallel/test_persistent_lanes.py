"""Per-lane randomness and BatchNorm on persistent replicas: the trainer stories of replicate hold as they
do for replicate, and both strategies train a dropout + checkpointing + BatchNorm model alike."""

import pytest
import test_lane_trainer as stories
from multilane.engine.run.trainer import Trainer
from test_lane_trainer import state, task_file  # noqa: F401 (task_file is a fixture)


@pytest.fixture
def persistent_config(make_config):
    return lambda **kw: make_config(devices__strategy="persistent", **kw)


@pytest.mark.parametrize(
    "story",
    [
        stories.test_dropout_under_checkpointing_resumes_bitwise_on_three_lanes,
        stories.test_the_seed_reproduces_a_multi_lane_dropout_run,
        stories.test_running_stats_keep_updating_when_the_first_lane_gets_nothing,
        stories.test_sync_batchnorm_inside_checkpointing_fails_the_first_step_with_one_line,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_issue_10_trainer_stories_hold_on_persistent_replicas(persistent_config, task_file, story):  # noqa: F811
    story(persistent_config, task_file)


def test_sync_batchnorm_on_persistent_replicas_trains_like_one_device(persistent_config, task_file):  # noqa: F811
    stories.test_sync_batchnorm_trains_like_one_device_with_the_whole_batch(
        persistent_config, task_file, "cpu:0,cpu:1,cpu:2", [3, 1, 2]
    )


@pytest.mark.parametrize("sync", [False, True])
def test_dropout_checkpointing_and_batchnorm_train_alike_on_both_strategies(make_config, task_file, sync):  # noqa: F811
    def train(strategy):
        cfg = make_config(
            task__name=task_file,
            devices__use="cpu:0,cpu:1,cpu:2",
            devices__weights=[1, 3, 2],
            devices__strategy=strategy,
            devices__sync_batchnorm=sync,
            train__steps=8,
            data__batch_size=17,
            optim__name="sgd",
            optim__lr=0.05,
        )
        t = Trainer(cfg)
        assert t.run().status == "finished"
        return state(t)

    a, b = train("persistent"), train("replicate")
    for k in b:
        scale = b[k].abs().max().clamp_min(1e-300) if b[k].is_floating_point() else 1
        assert ((a[k] - b[k]).abs().max() / scale).item() <= 1e-10, k
