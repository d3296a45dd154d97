"""Dataset loaders: shapes, ranges, class balance, clear errors, and FedProx Synthetic properties."""

from __future__ import annotations

import gzip
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import ConfigError, DatasetNotFoundError, PayloadError
from simulations.datasets import (
    FASHION_MNIST_FILES,
    SYSTEM_FASHION_MNIST_DIR,
    Dataset,
    concat_devices,
    load_dataset,
    load_digits_dataset,
    load_fashion_mnist,
    load_mnist_5k,
    normalization_stats,
    synthetic_fedprox,
)

needs_fashion = pytest.mark.skipif(
    not all((SYSTEM_FASHION_MNIST_DIR / f).is_file() for f in FASHION_MNIST_FILES),
    reason="Debian package dataset-fashion-mnist is not installed",
)


@pytest.fixture(scope="module")
def fashion() -> Dataset:
    return load_fashion_mnist(SYSTEM_FASHION_MNIST_DIR)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def write_tiny_fashion(directory: Path, n_train: int = 6, n_test: int = 4) -> None:
    write_idx(directory / "train-images-idx3-ubyte.gz", np.full((n_train, 28, 28), 255))
    write_idx(directory / "train-labels-idx1-ubyte.gz", np.arange(n_train) % 10)
    write_idx(directory / "t10k-images-idx3-ubyte.gz", np.zeros((n_test, 28, 28)))
    write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.arange(n_test) % 10)


def write_blank_fashion(directory: Path) -> None:
    """20 train and 4 test images, every pixel 0 (a standard deviation of 0); labels 0..9 twice, and 0..3."""
    write_idx(directory / "train-images-idx3-ubyte.gz", np.zeros((20, 28, 28)))
    write_idx(directory / "train-labels-idx1-ubyte.gz", np.arange(20) % 10)
    write_idx(directory / "t10k-images-idx3-ubyte.gz", np.zeros((4, 28, 28)))
    write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.arange(4))


@needs_fashion
def test_fashion_mnist_shapes_and_balance(fashion: Dataset) -> None:
    assert fashion.name == "fashion-mnist"
    assert fashion.x_train.shape == (60000, 1, 28, 28)
    assert fashion.x_test.shape == (10000, 1, 28, 28)
    assert fashion.x_train.dtype == np.float32 and fashion.y_train.dtype == np.int64
    assert fashion.num_classes == 10 and fashion.input_shape == (1, 28, 28)
    assert np.bincount(fashion.y_train).tolist() == [6000] * 10
    assert np.bincount(fashion.y_test).tolist() == [1000] * 10
    assert fashion.x_train.min() == 0.0 and fashion.x_train.max() == 1.0
    mean, std = normalization_stats(fashion.x_train)
    assert mean == pytest.approx(0.2860, abs=1e-3)  # the usual Fashion-MNIST train statistics
    assert std == pytest.approx(0.3530, abs=1e-3)


def test_fashion_mnist_from_user_dir(tmp_path: Path) -> None:
    write_tiny_fashion(tmp_path)
    data = load_fashion_mnist(tmp_path)
    assert data.x_train.shape == (6, 1, 28, 28) and data.x_test.shape == (4, 1, 28, 28)
    assert np.all(data.x_train == 1.0) and np.all(data.x_test == 0.0)
    assert data.y_train.tolist() == [0, 1, 2, 3, 4, 5]


def test_fashion_mnist_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fashion-mnist").mkdir()
    write_tiny_fashion(tmp_path / "fashion-mnist", n_train=3)
    monkeypatch.setenv("FEDCORE_DATA", str(tmp_path))
    assert load_fashion_mnist().x_train.shape[0] == 3


def test_fashion_mnist_env_dir_incomplete_says_which_copy_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FEDCORE_DATA pointing at the four files themselves (not at a directory holding fashion-mnist/) was passed
    over for the system copy without a word: a user's own 3-example copy silently became the system's."""
    import simulations.datasets as datasets_mod

    system = tmp_path / "system"
    system.mkdir()
    write_tiny_fashion(system, n_train=5)
    monkeypatch.setattr(datasets_mod, "SYSTEM_FASHION_MNIST_DIR", system)
    user = tmp_path / "user"
    user.mkdir()
    write_tiny_fashion(user, n_train=3)  # flat, where $FEDCORE_DATA/fashion-mnist/ is looked for
    monkeypatch.setenv("FEDCORE_DATA", str(user))
    with caplog.at_level("WARNING", logger="simulations.datasets"):
        assert load_fashion_mnist().x_train.shape[0] == 5  # the documented fallback, now said out loud
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{user / 'fashion-mnist'}: missing train-images-idx3-ubyte.gz" in warning
    assert f"loading Fashion-MNIST from {system} instead" in warning
    assert f"move them into {user / 'fashion-mnist'}/ or pass --data-dir {user}" in warning
    shutil.rmtree(system)
    system.mkdir()  # no system copy: the error says where the files are and how to use them
    with pytest.raises(DatasetNotFoundError, match=f"the four files lie in {user} itself"):
        load_fashion_mnist()


@pytest.mark.parametrize(("n_train", "n_test", "split"), [(0, 4, "train"), (6, 0, "t10k")])
def test_fashion_mnist_empty_split_refused(tmp_path: Path, n_train: int, n_test: int, split: str) -> None:
    """A t10k file of 0 images loaded, and the run trained without ever evaluating (only a warning about a
    metric left out of the averages each round)."""
    write_tiny_fashion(tmp_path, n_train=n_train, n_test=n_test)
    with pytest.raises(PayloadError, match=f"the {split} split would be empty"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_missing_files_named(tmp_path: Path) -> None:
    write_tiny_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_fashion_mnist(tmp_path)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte.gz" in message and "train-images-idx3-ubyte.gz" in message
    assert "train-labels-idx1-ubyte.gz" not in message
    assert "apt-get install dataset-fashion-mnist" in message and "FEDCORE_DATA" in message
    with pytest.raises(FileNotFoundError, match=r"t10k-images-idx3-ubyte\.gz"):
        load_fashion_mnist(tmp_path / "does-not-exist")


def test_fashion_mnist_corrupt_gzip(tmp_path: Path) -> None:
    write_tiny_fashion(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"this is not gzip at all")
    with pytest.raises(PayloadError, match=r"train-images-idx3-ubyte\.gz is not a readable gzip"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_bad_magic_and_truncation(tmp_path: Path) -> None:
    write_tiny_fashion(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    write_idx(labels, np.zeros((6, 2)))  # 2-D where a 1-D label file is expected
    with pytest.raises(PayloadError, match="magic 00000802"):
        load_fashion_mnist(tmp_path)
    with gzip.open(labels, "wb") as handle:  # header says 6 labels, body holds 5
        handle.write(bytes([0, 0, 8, 1]) + np.array([6], dtype=">u4").tobytes() + bytes(5))
    with pytest.raises(PayloadError, match="truncated or corrupt"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_count_mismatch(tmp_path: Path) -> None:
    write_tiny_fashion(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(3))
    with pytest.raises(PayloadError, match=r"4 images but .* 3 labels"):
        load_fashion_mnist(tmp_path)


def test_mnist_5k_split_and_range() -> None:
    data = load_mnist_5k()
    assert data.x_train.shape == (4000, 1, 28, 28) and data.x_test.shape == (1000, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_test.dtype == np.int64
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    assert np.bincount(data.y_test).tolist() == [100] * 10  # stratified: 500 per digit in the file
    again, other = load_mnist_5k(seed=0), load_mnist_5k(seed=1)
    np.testing.assert_array_equal(again.y_train, data.y_train)
    np.testing.assert_array_equal(again.x_test, data.x_test)
    assert not np.array_equal(other.x_test, data.x_test)


def test_digits() -> None:
    data = load_digits_dataset(test_fraction=0.25, seed=2)
    assert data.x_train.shape[1:] == (1, 8, 8) and data.input_shape == (1, 8, 8)
    assert data.x_train.shape[0] + data.x_test.shape[0] == 1797
    assert abs(data.x_test.shape[0] - 0.25 * 1797) <= 10
    assert float(data.x_train.max()) == 1.0 and float(data.x_train.min()) == 0.0
    assert set(np.unique(data.y_test).tolist()) == set(range(10))
    with pytest.raises(ConfigError, match="test_fraction"):
        load_digits_dataset(test_fraction=1.0)


def test_load_dataset_dispatch() -> None:
    assert load_dataset("digits", seed=1).name == "digits"
    with pytest.raises(ConfigError, match="fashion-mnist, mnist-5k, digits"):
        load_dataset("cifar-10")


def test_normalization_stats_by_hand() -> None:
    assert normalization_stats(np.array([0.0, 1.0, 1.0, 2.0], dtype=np.float32)) == (1.0, pytest.approx(0.5**0.5))
    with pytest.raises(ConfigError):
        normalization_stats(np.array([]))


def test_synthetic_fedprox_shapes_and_reproducibility() -> None:
    devices = synthetic_fedprox(0.5, 0.5, seed=3)
    assert len(devices) == 30
    for x_train, y_train, x_test, y_test in devices:
        n = len(y_train) + len(y_test)
        assert n >= 50
        assert len(y_train) == int(0.9 * n)
        assert x_train.shape == (len(y_train), 60) and x_test.shape == (len(y_test), 60)
        assert x_train.dtype == np.float32 and y_train.dtype == np.int64
        assert y_train.min() >= 0 and y_train.max() <= 9
    again = synthetic_fedprox(0.5, 0.5, seed=3)
    for a, b in zip(devices, again, strict=True):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_array_equal(u, v)
    other = synthetic_fedprox(0.5, 0.5, seed=4)
    assert [len(d[1]) for d in other] != [len(d[1]) for d in devices]


def test_synthetic_heterogeneity_grows_with_alpha_beta() -> None:
    def device_stats(alpha: float, beta: float) -> tuple[float, float]:
        devices = synthetic_fedprox(alpha, beta, seed=0)
        feature_means = [float(d[0].mean()) for d in devices]
        entropies = []
        for d in devices:
            p = np.bincount(np.concatenate([d[1], d[3]]), minlength=10) / (len(d[1]) + len(d[3]))
            p = p[p > 0]
            entropies.append(float(-(p * np.log(p)).sum()))
        return float(np.std(feature_means)), float(np.mean(entropies))

    spread_00, entropy_00 = device_stats(0.0, 0.0)
    spread_11, entropy_11 = device_stats(1.0, 1.0)
    # v_k ~ N(B_k, 1): with beta = 0 a device's mean feature has std ~ 1/sqrt(60) ~ 0.13; with beta = 1, ~1
    assert spread_00 < 0.3 < 0.6 < spread_11
    # shifted features make one class dominate each device: lower label entropy
    assert entropy_11 < entropy_00


def test_synthetic_concat_devices() -> None:
    devices = synthetic_fedprox(0.0, 0.0, num_devices=4, seed=1)
    data, parts = concat_devices(devices, name="synthetic(0,0)")
    assert data.x_train.shape == (sum(len(d[1]) for d in devices), 60) and data.input_shape == (60,)
    assert [p.size for p in parts] == [len(d[1]) for d in devices]
    np.testing.assert_array_equal(data.x_train[parts[2]], devices[2][0])
    np.testing.assert_array_equal(data.y_test[-len(devices[3][3]) :], devices[3][3])


def test_synthetic_rejects_negative_std() -> None:
    with pytest.raises(ConfigError, match="beta"):
        synthetic_fedprox(0.0, -1.0)


def test_copy_of_system_files_loads(tmp_path: Path) -> None:
    # a user directory holding the real (compressed) label files parses with the same counts
    if not (SYSTEM_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz").is_file():
        pytest.skip("dataset-fashion-mnist not installed")
    write_tiny_fashion(tmp_path, n_train=10000, n_test=10000)
    shutil.copy(SYSTEM_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz", tmp_path)
    assert np.bincount(load_fashion_mnist(tmp_path).y_test).tolist() == [1000] * 10


def test_prepared_shards_are_views_of_the_partition_rows_in_client_order() -> None:
    """PreparedData holds one client-ordered copy of the partitioned rows: client k's shard is a view of
    x_train[offsets[k]:offsets[k + 1]] and equals the dataset's rows of its partition, in the partition's order."""
    import torch

    from simulations.config import DataConfig
    from simulations.tasks import PreparedData, prepare_data

    config = DataConfig(dataset="digits", num_clients=7, partition="dirichlet", alpha=0.3, normalize=False)
    prepared = prepare_data(config, 3)
    assert isinstance(prepared, PreparedData)
    dataset = load_dataset("digits", seed=3)
    sizes = [len(part) for part in prepared.partitions]
    assert len(set(sizes)) > 1  # unequal shards: offsets that a wrong cumulative sum would misplace
    assert prepared.offsets.tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for k, part in enumerate(prepared.partitions):
        x, y = prepared.shard(k)
        assert x._base is prepared.x_train and y._base is prepared.y_train  # views, no copy per client
        np.testing.assert_array_equal(x.numpy(), dataset.x_train[part])
        np.testing.assert_array_equal(y.numpy(), dataset.y_train[part])
    assert torch.equal(prepared.x_train, torch.from_numpy(dataset.x_train[np.concatenate(prepared.partitions)]))
    for wrong in (-1, 7):
        with pytest.raises(ConfigError, match=f"client {wrong} is not one of the 7 clients"):
            prepared.shard(wrong)


def test_the_makefile_note_on_fashion_mnist_works_when_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make data` without root told users to put the files "in a directory and set FEDCORE_DATA to it", which the
    loader never reads ($FEDCORE_DATA/fashion-mnist/ is where it looks); follow the note as written."""
    import re

    import simulations.datasets as datasets_mod

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    note = re.search(r"put its four \*-ubyte\.gz files in (\S+?)/? and set FEDCORE_DATA=(\S+?)\.\"", makefile)
    assert note is not None, "the Makefile's note no longer says where the files go and what FEDCORE_DATA names"
    files_dir, env_value = (tmp_path / note[1].replace("DIR", "data")), str(tmp_path / note[2].replace("DIR", "data"))
    files_dir.mkdir(parents=True)
    write_tiny_fashion(files_dir, n_train=3)
    monkeypatch.setattr(datasets_mod, "SYSTEM_FASHION_MNIST_DIR", tmp_path / "no-system-copy")
    monkeypatch.setenv("FEDCORE_DATA", env_value)
    assert load_fashion_mnist().x_train.shape[0] == 3


def test_fashion_mnist_data_dir_one_level_up_names_the_right_one(tmp_path: Path) -> None:
    """--data-dir given $FEDCORE_DATA's layout (a directory holding fashion-mnist/) only listed four missing files."""
    (tmp_path / "fashion-mnist").mkdir()
    write_tiny_fashion(tmp_path / "fashion-mnist")
    with pytest.raises(DatasetNotFoundError, match=f"pass --data-dir {tmp_path / 'fashion-mnist'}\\)"):
        load_fashion_mnist(tmp_path)
    assert load_fashion_mnist(tmp_path / "fashion-mnist").x_train.shape[0] == 6


def test_constant_inputs_are_refused_before_normalizing_them_to_nan(tmp_path: Path) -> None:
    """All-blank images have a standard deviation of 0: normalizing divided by it, every input became NaN, and the
    run failed at round 1 with every update rejected as NaN ("check the client's learning rate")."""
    from simulations.config import DataConfig
    from simulations.tasks import prepare_data

    with pytest.raises(PayloadError, match=r"mean is 0\.25 and standard deviation 0\.0: every value is the same"):
        normalization_stats(np.full((3, 4), 0.25, dtype=np.float32))
    with pytest.raises(PayloadError, match="a value is not finite"):
        normalization_stats(np.array([0.0, np.inf]))
    with pytest.raises(PayloadError, match="a value is not finite"):
        normalization_stats(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(PayloadError, match="too large for float64"):  # finite, but the variance overflows
        normalization_stats(np.array([1e200, -1e200]))
    write_blank_fashion(tmp_path)
    config = DataConfig(dataset="fashion-mnist", data_dir=tmp_path, num_clients=2, partition="iid")
    with pytest.raises(PayloadError, match=r"--no-normalize"):
        prepare_data(config, 0)
    unnormalized = prepare_data(replace(config, normalize=False), 0)  # what the message offers runs
    assert unnormalized.num_clients == 2 and float(unnormalized.x_test.abs().sum()) == 0.0


def test_the_partition_report_reads_only_labels_so_blank_images_still_report(tmp_path: Path) -> None:
    """`fedcore partition` normalized the inputs it never shows; with constant inputs now refused by
    normalization_stats, it must not normalize (nor spend the time)."""
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    write_blank_fashion(data)
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "partition", "--data-dir", str(data), "--clients", "2",
         "--partition", "iid", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "samples per client: min 10, p10 10, median 10, p90 10, max 10 (mean 10.0)" in proc.stdout
