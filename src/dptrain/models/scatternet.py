"""ScatterNet features and the CNN trained on them, after Tramer & Boneh, "Differentially Private Learning Needs
Better Features (or Much More Data)" (ICLR 2021).

The features are the scattering transform of Bruna & Mallat, "Invariant Scattering Convolution Networks" (Oyallon
& Mallat's 2-D version, computed by kymatio): with J = 2 scales and L = 8 orientations a 28x28 greyscale image
becomes 81 channels of 7x7: 1 order-0 channel (the image averaged by a Gaussian low-pass filter), J L = 16 order-1
channels (|x * psi_1| low-passed) and L^2 J (J - 1) / 2 = 64 order-2 channels (||x * psi_1| * psi_2| low-passed),
each subsampled by 2^J.

Privacy: the transform is a fixed function of ONE image (its filters are chosen in advance, nothing is learned or
measured on the data set), so computing features for every training example costs no privacy; a model trained
privately on the features is as private as one trained on the pixels. The same holds for the model's input
normalisation, a GroupNorm that normalises each example by its own statistics.

kymatio 0.3.0's ``kymatio.torch`` module imports its 3-D frontend, which needs ``scipy.special.sph_harm`` (removed
in scipy 1.17); the 2-D torch frontend it re-exports as ``Scattering2D`` is imported here directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dptrain.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_CACHE_DIR",
    "scatter_linear",
    "scatternet_split",
    "cache_file",
    "cached_fashion_mnist_features",
    "cached_features",
    "scatter_cnn_fmnist",
    "scatter_features",
    "scattering_channels",
]

#: Where :func:`cached_fashion_mnist_features` keeps its .npz files by default (relative to the working directory).
DEFAULT_CACHE_DIR = "runs/cache"
#: Images per call of the scattering transform (measured on 2 CPU cores: 256 to 1024 are equally fast, 64 is
#: 30% slower).
DEFAULT_BATCH_SIZE = 512
_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def scattering_channels(J: int, L: int = 8) -> int:
    """Channels of the order-2 scattering transform: 1 + J L + L^2 J (J - 1) / 2 (81 for J = 2, L = 8)."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _check_scale(J, L) -> tuple[int, int]:
    for name, value in (("J", J), ("L", L)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"scattering {name} must be an integer >= 1, got {value!r}")
    return J, L


@functools.lru_cache(maxsize=8)
def _scattering(J: int, L: int, shape: tuple[int, int]) -> nn.Module:
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    return ScatteringTorch2D(J=J, shape=shape, L=L)


def scatter_features(
    images: torch.Tensor,
    J: int = 2,
    L: int = 8,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = False,
    threads: int | None = 1,
) -> torch.Tensor:
    """ScatterNet features of greyscale images: (N, 1, H, W) float -> (N, K, H / 2^J, W / 2^J) float32 with
    K = :func:`scattering_channels` (J, L); for 28x28 images and J = 2, L = 8: (N, 81, 7, 7). Channel 0 is order 0,
    channels 1..J L order 1, the rest order 2 (kymatio's order, the one Tramer & Boneh trained on).

    Images should hold pixels in [0, 1] (Tramer & Boneh's input). Computed in batches of ``batch_size`` images,
    with a progress bar when ``progress``, on ``threads`` torch threads (None: torch's setting). One thread is the
    default: measured on 2 cores, 1000 images take 1.6 s on one thread and on two alike when the machine is idle,
    but 28 s on two (against 1.7 s on one) when other processes keep the cores busy. Data-independent: no privacy
    cost (see the module docstring)."""
    J, L = _check_scale(J, L)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be None or an integer >= 1, got {threads!r}")
    images = torch.as_tensor(images)
    if images.dim() != 4 or images.shape[1] != 1 or not images.dtype.is_floating_point:
        raise DataError(
            f"scatter_features expects float greyscale images of shape (N, 1, H, W), got {images.dtype} of shape "
            f"{list(images.shape)}"
        )
    h, w = images.shape[2:]
    if h % 2**J or w % 2**J:
        raise DataError(f"image sides must be multiples of 2^J = {2**J}, got {h}x{w}")
    scattering = _scattering(J, L, (int(h), int(w)))
    out = torch.empty(len(images), scattering_channels(J, L), h // 2**J, w // 2**J, dtype=torch.float32)
    from tqdm import tqdm

    saved = torch.get_num_threads()
    bar = tqdm(total=len(images), desc=f"ScatterNet J={J}", unit="image", disable=not progress)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        with torch.no_grad():
            for start in range(0, len(images), batch_size):
                chunk = images[start : start + batch_size].to(torch.float32)
                out[start : start + len(chunk)] = scattering(chunk).reshape(len(chunk), *out.shape[1:])
                bar.update(len(chunk))
    finally:
        bar.close()
        torch.set_num_threads(saved)
    return out


# --- the cache ----------------------------------------------------------------------------------------------


def cache_file(cache_dir: str | os.PathLike, name: str, J: int, L: int = 8) -> Path:
    """The cache file of data set ``name``'s features at scale J (and L orientations)."""
    return Path(cache_dir) / f"{name}-scatternet-J{J}-L{L}.npz"


def _fingerprint(arrays) -> str:
    """SHA-256 of the input arrays (shape, dtype and bytes): a cache holds the features of exactly these inputs."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(torch.as_tensor(a).numpy())
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def _read_cache(path: Path, J: int, L: int, fingerprint: str) -> tuple[torch.Tensor, ...] | None:
    """The cached arrays, or None when the file is absent, unreadable or holds features of other inputs."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            if int(archive["J"]) != J or int(archive["L"]) != L or str(archive["fingerprint"]) != fingerprint:
                return None
            return tuple(torch.from_numpy(np.array(archive[k])) for k in _ARRAYS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically (a temporary file renamed into place): a run stopped mid-write leaves no half cache. The
    features of the training examples are as sensitive as the examples (nearly invertible): the file is the owner's
    alone (0600, mkstemp's), in a folder made the owner's alone (0700) when this makes it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_features(
    path: str | os.PathLike,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    J: int = 2,
    L: int = 8,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features of x_train, y_train, features of x_test, y_test), read from the .npz at ``path`` when it holds the
    features of exactly these images at this (J, L), else computed with :func:`scatter_features` and written there
    (float32 features, int64 labels). Feature extraction is data-independent: no privacy cost."""
    J, L = _check_scale(J, L)
    path = Path(path)
    fingerprint = _fingerprint((x_train, y_train, x_test, y_test))
    cached = _read_cache(path, J, L, fingerprint)
    if cached is not None:
        return cached  # type: ignore[return-value]
    f_train = scatter_features(x_train, J, L, batch_size, progress)
    f_test = scatter_features(x_test, J, L, batch_size, progress)
    y_train = torch.as_tensor(y_train).to(torch.int64)
    y_test = torch.as_tensor(y_test).to(torch.int64)
    arrays = {"x_train": f_train, "y_train": y_train, "x_test": f_test, "y_test": y_test}
    _write_cache(
        path,
        {k: v.numpy() for k, v in arrays.items()}
        | {"J": np.int64(J), "L": np.int64(L), "fingerprint": np.str_(fingerprint)},
    )
    return f_train, y_train, f_test, y_test


def cached_fashion_mnist_features(
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    J: int = 2,
    L: int = 8,
    directory: str | os.PathLike | None = None,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's ScatterNet features (x_train (60000, 81, 7, 7), y_train, x_test (10000, 81, 7, 7), y_test for
    J = 2): images from :func:`dptrain.data.loaders.load_fashion_mnist` (``directory``, default the system's copy) with
    pixels in [0, 1], features computed once (about 2 minutes on 2 CPU cores) and cached in ``cache_dir``, keyed by
    J and L. Feature extraction is data-independent: no privacy cost."""
    from dptrain.data.loaders import load_fashion_mnist

    split = load_fashion_mnist(directory, pixels="raw")
    return cached_features(
        cache_file(cache_dir, "fashion-mnist", J, L),
        split.train.x,
        split.train.y,
        split.test.x,
        split.test.y,
        J=J,
        L=L,
        progress=progress,
    )


# --- the model ----------------------------------------------------------------------------------------------


def scatter_cnn_fmnist(num_classes: int = 10) -> nn.Sequential:
    """Tramer & Boneh's CNN on (81, 7, 7) ScatterNet features of 28x28 images (their Fashion-MNIST / MNIST model):
    GroupNorm(27 groups, 81 channels, no affine parameters) input normalisation, then
    Conv2d(81, 16, 3, stride 2, padding 1) - Tanh - Conv2d(16, 32, 3, padding 1) - Tanh - Flatten -
    Linear(512, 32) - Tanh - Linear(32, num_classes); 33,066 parameters for 10 classes.

    The GroupNorm normalises each example by the mean and variance of its own channels, so the normalisation is a
    per-example function and costs no privacy. (Xiao, Wan & Devadas, "Differentially Private Deep Learning with
    ModelMix", instead normalise with batch-norm statistics of the training features and spend epsilon = 0.695 of
    their budget releasing them privately; here no budget goes to normalisation.)"""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}")
    return nn.Sequential(
        nn.GroupNorm(27, 81, affine=False),
        nn.Conv2d(81, 16, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(16, 32, 3, stride=1, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, num_classes),
    )


def scatter_linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Tramer & Boneh's linear model on ScatterNet features ("Differentially Private Learning Needs Better Features
    (or Much More Data)", ScatterNet + linear): GroupNorm(27 groups, no affine parameters) on the (K, H, W) features,
    then one Linear layer (3,969 x 10 weights for Fashion-MNIST's (81, 7, 7)). The GroupNorm normalises each example
    by its own channels' statistics: a per-example function, no privacy cost (see :func:`scatter_cnn_fmnist`)."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.GroupNorm(27, channels, affine=False), nn.Flatten(), nn.Linear(channels * height * width, num_classes)
    )


def scatternet_split(split, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, J: int = 2, progress: bool = False):
    """A :class:`~dptrain.data.datasets.DataSplit` of greyscale images (pixels in [0, 1]) as one of their ScatterNet
    features (``data.features = "scatternet"``), computed once and cached in ``cache_dir`` by the images' SHA-256.
    A fixed function of each image: no privacy cost, and the split's test set stays as public as it was."""
    from dataclasses import replace

    from dptrain.data.datasets import ArrayDataset

    tr, te = split.train, split.test
    for part in (tr, te):
        if part.x.dim() != 4 or part.x.shape[1] != 1:
            raise DataError(
                f"data.features = \"scatternet\" takes greyscale images (N, 1, H, W), got examples of shape "
                f"{tuple(part.x.shape[1:])}"
            )
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in tr.name)[:40] or "data"
    x_train, y_train, x_test, y_test = cached_features(
        cache_file(cache_dir, name, J), tr.x, tr.y, te.x, te.y, J=J, progress=progress
    )
    return replace(
        split,
        train=ArrayDataset(x_train, y_train, tr.num_classes, tr.name),
        test=ArrayDataset(x_test, y_test, te.num_classes, te.name),
        description=f"{split.description}, as ScatterNet features (J = {J}, {tuple(x_train.shape[1:])})",
    )
