"""Specification of accordion.harness.data: loading the tasks and sharding their batches."""

from __future__ import annotations

import functools
import pickle
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from accordion.harness.data import (
    TASKS,
    ClassificationData,
    classification_batches,
    language_batches,
    language_steps,
    load_task,
    steps_per_epoch,
)
from accordion.harness.data import mnist1d as hd_mnist1d

CIFAR10_MEAN = torch.tensor((0.4914, 0.4822, 0.4465)).view(1, 3, 1, 1)
CIFAR10_STD = torch.tensor((0.2470, 0.2435, 0.2616)).view(1, 3, 1, 1)


# --------------------------------------------------------------------------- fixtures


def indexed_data(n: int = 50) -> ClassificationData:
    """Sample i has input [i] and label i, so batches reveal which samples they hold."""
    x = torch.arange(n, dtype=torch.float32)[:, None]
    y = torch.arange(n)
    return ClassificationData("synthetic", x, y, x.clone(), y.clone(), n, False, "mnist1d-cnn")


def write_pickle(path: Path, images: np.ndarray, labels: list[int], label_key: bytes) -> None:
    with open(path, "wb") as f:
        pickle.dump({b"data": images.reshape(len(images), -1), label_key: labels}, f)


def fake_cifar10(root: Path, train: int = 20, test: int = 10) -> Path:
    """A cifar-10-batches-py folder: ``train`` images over 5 batch files, ``test`` in test_batch."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (train + test, 3, 32, 32), dtype=np.uint8)
    labels = [i % 10 for i in range(train + test)]
    per_file = train // 5
    for b in range(5):
        part = slice(b * per_file, (b + 1) * per_file)
        write_pickle(folder / f"data_batch_{b + 1}", images[part], labels[part], b"labels")
    write_pickle(folder / "test_batch", images[train:], labels[train:], b"labels")
    return folder


def fake_cifar100(root: Path) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    train_images = rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8)
    test_images = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    write_pickle(folder / "train", train_images, [99, 0, 5, 7, 1, 2, 3, 4], b"fine_labels")
    write_pickle(folder / "test", test_images, [50, 51, 52, 53], b"fine_labels")
    return folder


def fake_wikitext(folder: Path, naming: str = "wiki.{split}.tokens") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    texts = {
        "train": "the cat sat\n\nthe dog <unk> ran\n",
        "valid": "the cat ran\n",
        "test": "a zebra sat\n",
    }
    for split, text in texts.items():
        (folder / naming.format(split=split)).write_text(text, encoding="utf8")
    return folder


def all_train_batches(data, global_batch, rank, world_size, epoch=0, seed=0):
    return list(
        classification_batches(
            data,
            global_batch=global_batch,
            rank=rank,
            world_size=world_size,
            epoch=epoch,
            seed=seed,
        )
    )


def normalised(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - CIFAR10_MEAN) / CIFAR10_STD


# --------------------------------------------------------------------------- sharding


def test_ranks_take_disjoint_slices_that_together_cover_each_global_batch():
    data = indexed_data(48)
    whole = all_train_batches(data, global_batch=16, rank=0, world_size=1)
    shards = [all_train_batches(data, global_batch=16, rank=r, world_size=4) for r in range(4)]
    for step, (_, global_labels) in enumerate(whole):
        parts = [shards[r][step][1] for r in range(4)]
        assert all(len(part) == 4 for part in parts)
        # Rank r holds the r-th contiguous quarter, so the concatenation is the global batch.
        assert torch.equal(torch.cat(parts), global_labels)
        assert len(set(torch.cat(parts).tolist())) == 16


def test_same_seed_and_epoch_give_the_same_batches():
    data = indexed_data()
    first = all_train_batches(data, global_batch=10, rank=1, world_size=2, epoch=3, seed=7)
    second = all_train_batches(data, global_batch=10, rank=1, world_size=2, epoch=3, seed=7)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))


def test_a_different_epoch_or_seed_gives_a_different_order():
    data = indexed_data()
    base = torch.cat([y for _, y in all_train_batches(data, 10, 0, 1, epoch=0, seed=0)])
    other_epoch = torch.cat([y for _, y in all_train_batches(data, 10, 0, 1, epoch=1, seed=0)])
    other_seed = torch.cat([y for _, y in all_train_batches(data, 10, 0, 1, epoch=0, seed=1)])
    assert not torch.equal(base, other_epoch)
    assert not torch.equal(base, other_seed)
    assert sorted(base.tolist()) == sorted(other_epoch.tolist()) == list(range(50))


def test_every_rank_takes_the_same_number_of_steps():
    data = indexed_data(50)
    counts = [len(all_train_batches(data, 12, rank, 3)) for rank in range(3)]
    assert counts == [steps_per_epoch(data, 12)] * 3 == [4, 4, 4]


def test_the_last_incomplete_global_batch_is_dropped():
    data = indexed_data(50)
    batches = all_train_batches(data, global_batch=16, rank=0, world_size=1)
    assert [len(y) for _, y in batches] == [16, 16, 16]
    assert steps_per_epoch(data, 16) == 3
    assert len(set(torch.cat([y for _, y in batches]).tolist())) == 48


def test_global_batch_not_a_multiple_of_world_size_raises():
    with pytest.raises(ValueError, match=r"global_batch \(10\).*world_size \(3\)"):
        classification_batches(
            indexed_data(), global_batch=10, rank=0, world_size=3, epoch=0, seed=0
        )


def test_rank_outside_the_world_raises():
    with pytest.raises(ValueError, match="rank"):
        classification_batches(
            indexed_data(), global_batch=8, rank=2, world_size=2, epoch=0, seed=0
        )


def test_global_batch_larger_than_the_training_set_raises():
    with pytest.raises(ValueError, match="global_batch"):
        classification_batches(
            indexed_data(8), global_batch=16, rank=0, world_size=1, epoch=0, seed=0
        )


# --------------------------------------------------------------------------- CIFAR


def test_cifar10_loads_from_the_extracted_folder(tmp_path):
    folder = fake_cifar10(tmp_path)
    data = load_task("cifar10", folder)
    assert data.x_train.shape == (20, 3, 32, 32) and data.x_train.dtype == torch.uint8
    assert data.x_test.shape == (10, 3, 32, 32)
    assert data.y_train.dtype == torch.int64 and data.y_train.tolist() == [
        i % 10 for i in range(20)
    ]
    assert (data.num_classes, data.augment, data.default_model) == (10, True, "resnet18")


def test_cifar10_loads_from_the_parent_folder(tmp_path):
    fake_cifar10(tmp_path)
    from_parent = load_task("cifar10", tmp_path)
    from_folder = load_task("cifar10", tmp_path / "cifar-10-batches-py")
    assert torch.equal(from_parent.x_train, from_folder.x_train)


def test_cifar100_reads_the_fine_labels(tmp_path):
    fake_cifar100(tmp_path)
    data = load_task("cifar100", str(tmp_path))
    assert data.num_classes == 100
    assert data.y_train.tolist() == [99, 0, 5, 7, 1, 2, 3, 4]
    assert data.y_test.tolist() == [50, 51, 52, 53]


def test_cifar_sample_counts_cut_the_arrays(tmp_path):
    data = load_task("cifar10", fake_cifar10(tmp_path), train_samples=6, test_samples=3)
    assert (len(data.x_train), len(data.y_train), len(data.x_test), len(data.y_test)) == (
        6,
        6,
        3,
        3,
    )


def test_missing_cifar_folder_raises_file_not_found_naming_the_paths(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as error:
        load_task("cifar10", missing)
    message = str(error.value)
    assert str(missing / "data_batch_1") in message
    assert str(missing / "cifar-10-batches-py" / "test_batch") in message
    assert (
        "Nothing is downloaded" in message
        and "https://www.cs.toronto.edu/~kriz/cifar.html" in message
    )


def test_cifar_without_data_dir_raises_value_error():
    with pytest.raises(ValueError, match="--data-dir"):
        load_task("cifar100")


def test_augmentation_keeps_shapes_and_yields_float_inputs(tmp_path):
    data = load_task("cifar10", fake_cifar10(tmp_path))
    batches = all_train_batches(data, global_batch=8, rank=1, world_size=2)
    assert len(batches) == 2
    for x, y in batches:
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
        assert y.shape == (4,) and y.dtype == torch.int64


def test_augmentation_is_deterministic_given_seed_epoch_and_rank(tmp_path):
    data = load_task("cifar10", fake_cifar10(tmp_path))
    first = all_train_batches(data, 20, rank=0, world_size=1, epoch=2, seed=5)
    second = all_train_batches(data, 20, rank=0, world_size=1, epoch=2, seed=5)
    assert torch.equal(first[0][0], second[0][0])


def test_augmentation_is_a_padded_crop_or_its_mirror_and_changes_some_images(tmp_path):
    data = load_task("cifar10", fake_cifar10(tmp_path))
    (x, y), *_ = all_train_batches(data, 20, rank=0, world_size=1, epoch=0, seed=3)
    # In the fake data, labels are i % 10, so recover each sample by matching its label pair.
    originals = {}
    for index in range(20):
        originals.setdefault(int(data.y_train[index]), []).append(index)
    # Zero padding is in pixel space, so padded pixels normalise to -mean/std.
    padded_pixels = torch.nn.functional.pad(data.x_train, (4, 4, 4, 4))
    padded = normalised(padded_pixels)
    changed = 0
    for image, label in zip(x, y):
        candidates = [
            crop
            for index in originals[int(label)]
            for top in range(9)
            for left in range(9)
            for crop in (
                padded[index, :, top : top + 32, left : left + 32],
                padded[index, :, top : top + 32, left : left + 32].flip(-1),
            )
        ]
        assert any(torch.allclose(image, crop) for crop in candidates)
        plain = [normalised(data.x_train[i : i + 1])[0] for i in originals[int(label)]]
        changed += not any(torch.allclose(image, p) for p in plain)
    assert changed >= 10  # 1 in 162 draws leaves an image unchanged


def test_test_batches_are_the_whole_test_set_in_order_normalised_and_not_augmented(tmp_path):
    data = load_task("cifar10", fake_cifar10(tmp_path))
    for rank in range(2):
        batches = list(
            classification_batches(
                data, global_batch=4, rank=rank, world_size=2, epoch=5, seed=9, train=False
            )
        )
        assert [len(y) for _, y in batches] == [4, 4, 2]
        x = torch.cat([x for x, _ in batches])
        assert torch.allclose(x, normalised(data.x_test))
        assert torch.equal(torch.cat([y for _, y in batches]), data.y_test)


# --------------------------------------------------------------------------- WikiText-2


def test_wikitext_vocabulary_comes_from_the_training_file_with_eos_per_line(tmp_path):
    data = load_task("wikitext2", fake_wikitext(tmp_path))
    # train: "the cat sat <eos> <eos> the dog <unk> ran <eos>", ids by first appearance
    assert data.train.tolist() == [0, 1, 2, 3, 3, 0, 4, 5, 6, 3]
    assert data.train.dtype == torch.int64
    assert data.valid.tolist() == [0, 1, 6, 3]
    assert data.vocab_size == 7 and data.default_model == "lstm"


def test_wikitext_unknown_test_words_map_to_unk(tmp_path):
    data = load_task("wikitext2", fake_wikitext(tmp_path))
    unk = 5  # "<unk>" appears in the training file
    assert data.test.tolist() == [unk, unk, 2, 3]


def test_wikitext_adds_unk_when_the_training_file_lacks_it(tmp_path):
    folder = fake_wikitext(tmp_path)
    (folder / "wiki.train.tokens").write_text("a b\n", encoding="utf8")
    data = load_task("wikitext2", folder)
    assert data.test.tolist() == [0, 3, 3, 2]  # a, zebra -> <unk>, sat -> <unk>, <eos>
    assert data.vocab_size == 4


def test_wikitext_accepts_txt_names_and_the_parent_folder(tmp_path):
    fake_wikitext(tmp_path / "wikitext-2", naming="{split}.txt")
    data = load_task("wikitext2", tmp_path)
    assert data.train.tolist() == [0, 1, 2, 3, 3, 0, 4, 5, 6, 3]


def test_missing_wikitext_files_raise_file_not_found_naming_the_paths(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_task("wikitext2", tmp_path)
    assert str(tmp_path / "wiki.train.tokens") in str(error.value)
    assert str(tmp_path / "train.txt") in str(error.value)


# --------------------------------------------------------------------------- language batches


def test_language_targets_are_the_inputs_shifted_by_one_token():
    tokens = torch.arange(100)
    windows = list(language_batches(tokens, batch_size_per_rank=2, rank=0, world_size=2, bptt=7))
    # 4 columns of 25 tokens: 24 shifted pairs per column, windows of 7, 7, 7, 3 rows.
    assert [len(x) for x, _ in windows] == [7, 7, 7, 3] and language_steps(tokens, 2, 2, 7) == 4
    for x, target in windows:
        assert x.shape == target.shape and x.shape[1] == 2
        assert torch.equal(target, x + 1)  # in an arange stream the next token is id + 1


def test_language_ranks_take_disjoint_contiguous_columns():
    tokens = torch.arange(103)  # 3 tokens trimmed off the 4 columns of 25

    def rank_inputs(rank: int) -> torch.Tensor:
        windows = language_batches(tokens, batch_size_per_rank=2, rank=rank, world_size=2)
        return torch.cat([x for x, _ in windows])

    columns = [rank_inputs(0), rank_inputs(1)]
    assert columns[0][:, 0].tolist() == list(range(0, 24))
    assert columns[0][:, 1].tolist() == list(range(25, 49))
    assert columns[1][:, 0].tolist() == list(range(50, 74))
    assert not set(columns[0].flatten().tolist()) & set(columns[1].flatten().tolist())


def test_language_stream_too_short_for_one_window_raises():
    with pytest.raises(ValueError, match="tokens"):
        language_batches(torch.arange(7), batch_size_per_rank=2, rank=0, world_size=2)


# --------------------------------------------------------------------------- MNIST-1D


@pytest.fixture
def small_mnist1d(monkeypatch):
    """300-sample MNIST-1D behind an empty in-process cache of its own, and no disk cache."""
    monkeypatch.setattr(hd_mnist1d, "_MNIST1D_NUM_SAMPLES", 300)
    fresh = functools.lru_cache(hd_mnist1d._mnist1d_arrays.__wrapped__)
    monkeypatch.setattr(hd_mnist1d, "_mnist1d_arrays", fresh)
    monkeypatch.delenv("ACCORDION_CACHE", raising=False)


def test_mnist1d_defaults_to_4000_train_and_4000_test_signals_of_length_40():
    data = load_task("mnist1d")
    assert data.x_train.shape == (4000, 40) and data.x_train.dtype == torch.float32
    assert data.x_test.shape == (4000, 40)
    assert data.y_train.dtype == torch.int64 and set(data.y_train.tolist()) == set(range(10))
    assert (data.num_classes, data.augment, data.default_model) == (10, False, "mnist1d-cnn")


def test_mnist1d_data_does_not_depend_on_the_seed():
    assert torch.equal(load_task("mnist1d", seed=0).x_train, load_task("mnist1d", seed=3).x_train)


def test_mnist1d_is_generated_offline_without_get_dataset(monkeypatch, small_mnist1d):
    import mnist1d.data

    def no_download(*args, **kwargs):
        raise AssertionError("get_dataset downloads: it must never be called")

    monkeypatch.setattr(mnist1d.data, "get_dataset", no_download)
    data = load_task("mnist1d", train_samples=100, test_samples=50)
    assert data.x_train.shape == (100, 40) and data.x_test.shape == (50, 40)


def test_mnist1d_generation_leaves_the_global_random_state_alone(small_mnist1d):
    np.random.seed(123)
    random.seed(123)
    load_task("mnist1d", train_samples=10, test_samples=10)
    after = (np.random.random(), random.random())
    np.random.seed(123)
    random.seed(123)
    assert after == (np.random.random(), random.random())


def test_mnist1d_disk_cache_under_accordion_cache_is_reused(monkeypatch, tmp_path, small_mnist1d):
    monkeypatch.setenv("ACCORDION_CACHE", str(tmp_path / "cache"))
    generated = load_task("mnist1d", train_samples=240, test_samples=60)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["mnist1d_n300.npz"]
    hd_mnist1d._mnist1d_arrays.cache_clear()
    import mnist1d.data

    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda *a, **k: 1 / 0)
    cached = load_task("mnist1d", train_samples=240, test_samples=60)
    assert torch.equal(generated.x_train, cached.x_train)
    assert torch.equal(generated.y_test, cached.y_test)


def test_mnist1d_more_samples_than_generated_raises():
    with pytest.raises(ValueError, match="train_samples"):
        load_task("mnist1d", train_samples=16_001)


# --------------------------------------------------------------------------- synthetic, errors


def test_synthetic_images_have_the_requested_shape_and_classes():
    data = load_task("synthetic", synthetic_shape=(3, 8, 8), synthetic_classes=4, train_samples=64)
    assert data.x_train.shape == (64, 3, 8, 8) and data.x_train.dtype == torch.float32
    assert data.x_test.shape == (256, 3, 8, 8)
    assert data.y_train.dtype == torch.int64
    assert 0 <= int(data.y_train.min()) and int(data.y_train.max()) < 4
    assert (data.num_classes, data.augment, data.default_model) == (4, False, "resnet18")


def test_synthetic_signals_default_to_the_mnist1d_cnn():
    data = load_task("synthetic", synthetic_shape=(40,))
    assert data.x_train.shape == (1024, 40) and data.default_model == "mnist1d-cnn"


def test_synthetic_data_is_determined_by_the_seed():
    a, b, c = (load_task("synthetic", synthetic_shape=(40,), seed=s) for s in (1, 1, 2))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


def test_unknown_task_raises_listing_the_tasks():
    with pytest.raises(ValueError) as error:
        load_task("imagenet")
    assert all(task in str(error.value) for task in TASKS)


@pytest.mark.parametrize("argument", ["train_samples", "test_samples"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_sample_counts_raise_naming_the_argument(argument, value):
    with pytest.raises(ValueError, match=argument):
        load_task("synthetic", **{argument: value})


@pytest.mark.parametrize("value", [2.0, True, "4"])
def test_a_count_of_the_wrong_type_is_a_type_error_naming_the_argument(value):
    with pytest.raises(TypeError, match="train_samples"):
        load_task("synthetic", train_samples=value)
    with pytest.raises(TypeError, match="global_batch"):
        classification_batches(
            indexed_data(), global_batch=value, rank=0, world_size=1, epoch=0, seed=0
        )


def test_mnist1d_later_loads_come_from_the_in_process_cache():
    # warm: generated once per process
    hd_mnist1d._mnist1d_arrays(hd_mnist1d._MNIST1D_NUM_SAMPLES)
    start = time.perf_counter()
    load_task("mnist1d")
    assert time.perf_counter() - start < 1.0
