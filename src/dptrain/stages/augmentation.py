"""Augmentation multiplicity: each example's gradient is the mean of the gradients of K augmented views of it, formed
BEFORE clipping (De, Berrada, Hayes, Smith & Balle, "Unlocking High-Accuracy Differentially Private Image
Classification through Scale", 2022, Section 3: "augmentation multiplicity").

    g_i = (1/K) sum_k grad loss(theta, view_k(x_i), y_i),   then clip(g_i) to C as before

One example still contributes one clipped vector of norm <= C, so the sensitivity, the noise and the ledger are those of
the same run without augmentation. The K views of a chunk of B examples are B*K rows for the per-example backend
(whichever it is: layer rules with factored forms, torch.func, the loop), and :func:`mean_of_views` turns their B*K
per-row gradients into B per-example means exactly, keeping a Linear's or an Embedding's factored form (the K views of
an example are K more positions of its sequence) where that is cheaper. Memory grows with K: a physical chunk holds
max_physical_batch_size // K examples (:meth:`Multiplicity.examples_per_chunk`).

The views: a random crop of the image padded with ``crop_padding`` zeros on each side (offsets uniform in
[0, 2 crop_padding] on each axis) and, with ``flip``, a horizontal flip with probability 1/2. Only images are
augmented: inputs [B, C, H, W] with 1 to 4 channels (grey, RGB, RGBA) of a floating dtype; anything else (token ids,
tabular rows, feature maps such as ScatterNet's 81 channels) is refused in one line.

Randomness: each step draws a key from the run's ``augmentation`` stream (:mod:`dptrain.randomness`), and the views of
example ``i`` (its index in the training set) are a keyed function of (i, k) for its views k = 1..K: a function of the
key and the example alone, so every chunking, every rank of a data-parallel run and a resumed run draw the same views,
and the stream advances by the same amount every step whatever the batch size. With ``privacy.secure_noise`` the key
is 256 bits from the AES-256-CTR stream and the function is AES-256 itself (a pseudorandom function); otherwise one
64-bit word from the run's generator and SplitMix64's output function at i K + k + 1 (Steele, Lea & Flood, "Fast
Splittable Pseudorandom Number Generators", 2014), as unpredictable as the run's other default streams.

Privacy: the views are privacy-relevant randomness, secret like the noise. The argument (docs/recipes.md): with the key
secret, the views of the examples are independent draws, independent of the data and of the sampling, so the run on
D and on D without example x can be coupled to give every other example the same views; each step's sum then moves
by one example's clipped mean, of norm <= C. With a key known to the attacker that coupling fails: removing an example
shifts the indices, hence the views, of the examples after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dptrain.errors import ConfigError, DataError
from dptrain.numbers import number_problem
from dptrain.stages.gradient_factors import (
    PerExampleGrads,
    _EmbeddingFactors,
    _LinearFactors,
    _SharedParts,
)
from dptrain.stages.layer_rules import ghost_pays

#: The keys of ``training.augment`` (and of the ``augment=`` option, as a dict).
AUGMENT_KEYS = ("multiplicity", "crop_padding", "flip")
#: Built-in data sets whose classes a horizontal flip does not preserve (a mirrored digit is not that digit).
NOT_MIRROR_SYMMETRIC = ("mnist", "digits")
#: Most channels an image may have (grey 1, RGB 3, RGBA 4); more is a feature map, not an image.
MAX_IMAGE_CHANNELS = 4

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the golden ratio in 64 bits)


@dataclass(frozen=True)
class Augmentation:
    """K augmented views per example (``multiplicity``), each a random crop of the image padded with
    ``crop_padding`` zeros, horizontally flipped with probability 1/2 when ``flip``."""

    multiplicity: int = 1
    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self) -> None:
        for key, minimum in (("multiplicity", 1), ("crop_padding", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum or number_problem(v) is not None:
                raise ConfigError(f"training.augment.{key} must be an integer >= {minimum} that fits in 64 bits, got {v!r}")
        if not isinstance(self.flip, bool):
            raise ConfigError(f"training.augment.flip must be true or false, got {self.flip!r}")

    @property
    def transforms(self) -> bool:
        """Whether a view differs from the image (a crop offset or a flip can be drawn)."""
        return self.crop_padding > 0 or self.flip


def make_augmentation(spec) -> Augmentation | None:
    """``training.augment`` (a dict of :data:`AUGMENT_KEYS`), an :class:`Augmentation`, or None/empty (none)."""
    if spec is None or isinstance(spec, Augmentation):
        return spec
    if not isinstance(spec, dict):
        raise ConfigError(
            f"training.augment must be a table {{ multiplicity = K, crop_padding = P, flip = true|false }}, got {spec!r}"
        )
    if not spec:
        return None
    unknown = sorted(set(spec) - set(AUGMENT_KEYS))
    if unknown:
        raise ConfigError(f"unknown key 'training.augment.{unknown[0]}'; accepted: {', '.join(AUGMENT_KEYS)}")
    return Augmentation(**spec)


def check_fits(augmentation: Augmentation | None, dataset: str, features: str = "none") -> None:
    """Refuse, from the config alone, augmentation where it cannot apply: images replaced by feature maps computed
    once from the un-augmented images (``data.features``), a horizontal flip on a built-in data set whose classes it
    changes (digits)."""
    if augmentation is not None and features != "none":
        raise ConfigError(
            f"training.augment views images, and data.features = {features!r} trains on feature maps computed once "
            "from the un-augmented images: use one or the other"
        )
    if augmentation is not None and augmentation.flip and dataset in NOT_MIRROR_SYMMETRIC:
        raise ConfigError(
            f"training.augment.flip = true mirrors the images of {dataset}, whose classes (digits) a mirror changes; "
            "set flip = false (crops still apply)"
        )


def check_images(x, what: str = "training inputs") -> None:
    """Augmentation applies to images only: a floating tensor [B, C, H, W] with 1 to 4 channels."""
    if (
        not torch.is_tensor(x)
        or not x.dtype.is_floating_point
        or x.dim() != 4
        or not 1 <= x.shape[1] <= MAX_IMAGE_CHANNELS
    ):
        got = f"{x.dtype} of shape {list(x.shape)}" if torch.is_tensor(x) else type(x).__name__
        raise DataError(
            f"training.augment applies to images: {what} must be a float tensor [B, C, H, W] with 1 to "
            f"{MAX_IMAGE_CHANNELS} channels, got {got} (features such as ScatterNet's are computed from the views "
            "inside the model, or trained without augmentation)"
        )
    if x.shape[3] <= MAX_IMAGE_CHANNELS:  # [B, 4, 4, 3] is also channels-last [B, H, W, C]: crops would cut channels
        raise DataError(
            f"training.augment applies to images [B, C, H, W] more than {MAX_IMAGE_CHANNELS} pixels wide: examples of "
            f"shape {list(x.shape[1:])} could also be channels-last [H, W, C], whose crops would cut the channels"
        )


def _prf_words(key: int | bytes, counter: np.ndarray) -> np.ndarray:
    """64 pseudorandom bits per counter: the first 8 bytes of AES-256 of the counter block under a 32-byte ``key`` (a
    pseudorandom function: ``privacy.secure_noise``), or SplitMix64's output at ``key + counter * gamma`` (an int key)."""
    if isinstance(key, bytes):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        blocks = np.zeros((len(counter), 2), dtype="<u8")
        blocks[:, 0] = counter
        encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
        out = encryptor.update(blocks.tobytes()) + encryptor.finalize()
        return np.frombuffer(out, dtype="<u8").reshape(-1, 2)[:, 0].astype(np.uint64)
    with np.errstate(over="ignore"):
        return _mix64(np.uint64(key) + counter * _GAMMA)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea & Flood 2014), on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def view_parameters(key: int | bytes, examples: torch.Tensor, augmentation: Augmentation):
    """(row offsets, column offsets, flips) of the K views of each example of ``examples`` (training-set indices),
    each [len(examples) * K] in view order (example-major): offsets uniform in [0, 2 crop_padding], flips with
    probability 1/2 (False without ``flip``). A function of ``key`` and the indices alone. (An offset is a 64-bit
    word reduced modulo 2 p + 1: a bias below 2^-40 for any padding p < 2^20.)"""
    k = augmentation.multiplicity
    idx = examples.detach().cpu().numpy().astype(np.uint64)
    counter = (idx[:, None] * np.uint64(k) + np.arange(1, k + 1, dtype=np.uint64)[None, :]).reshape(-1)
    h = _prf_words(key, counter)
    span = np.uint64(2 * augmentation.crop_padding + 1)
    dy = (h & np.uint64(0xFFFFFFFFFF)) % span  # low 40 bits
    dx = ((h >> np.uint64(20)) & np.uint64(0xFFFFFFFFFF)) % span  # bits 20..59
    flips = ((h >> np.uint64(63)) == 1) & augmentation.flip
    as_tensor = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return as_tensor(dy), as_tensor(dx), torch.from_numpy(flips)


def views(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flips: torch.Tensor, padding: int) -> torch.Tensor:
    """The views [N, C, H, W] of images ``x`` [N, C, H, W] (one image per view, repeated by the caller): image n
    padded with ``padding`` zeros on each side, cropped back to H x W at offset (dy[n], dx[n]) of the padded image,
    then mirrored left-right where flips[n]."""
    n, _, h, w = x.shape
    device = x.device
    if padding:
        padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
        rows = dy.to(device)[:, None] + torch.arange(h, device=device)[None, :]  # [N, H]
        cols = dx.to(device)[:, None] + torch.arange(w, device=device)[None, :]  # [N, W]
        batch = torch.arange(n, device=device)[:, None, None]
        x = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
    if bool(flips.any()):
        x = torch.where(flips.to(device)[:, None, None, None], x.flip(-1), x)
    return x


def _grouped(t: torch.Tensor, k: int) -> torch.Tensor:
    """[B K, ...] -> [B, K, ...]."""
    return t.reshape(t.shape[0] // k, k, *t.shape[1:])


def _as_positions(t: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row factors [B K, (T,) d] -> per-example sequences [B, K T, d]: the K views become positions."""
    if t.dim() == 2:
        return _grouped(t, k)
    return t.reshape(t.shape[0] // k, k * t.shape[1], *t.shape[2:])


def _mean_part(part, k: int):
    if isinstance(part, _SharedParts):
        return _SharedParts(tuple(_mean_part(p, k) for p in part.parts))
    if isinstance(part, _LinearFactors):
        delta, a = _as_positions(part.delta, k) / k, _as_positions(part.a, k)
        if ghost_pays(delta.shape[1], a.shape[2], delta.shape[2]):
            return _LinearFactors(delta, a)
        return torch.einsum("bto,bti->boi", delta, a)
    if isinstance(part, _EmbeddingFactors):
        ids = part.ids.reshape(part.ids.shape[0] // k, -1)
        return _EmbeddingFactors(ids, _as_positions(part.delta, k) / k, part.num_embeddings)
    if torch.is_tensor(part):
        return _grouped(part, k).mean(1)
    raise TypeError(f"no mean over views for per-example gradients of type {type(part).__name__}")


def mean_of_views(grads: PerExampleGrads, k: int) -> PerExampleGrads:
    """Per-row gradients of B K rows (the K views of each example, example-major) -> the B per-example means
    (1/K) sum_k g_{i,k}, exactly; factored forms stay factored where the Gram form is cheaper (:func:`ghost_pays`)."""
    if k == 1:
        return grads
    return PerExampleGrads({n: _mean_part(grads.parts()[n], k) for n in grads.names()})


class Multiplicity:
    """The per-example stage with augmentation multiplicity: the step's key (:meth:`new_step`), then for each chunk
    the views, the backend's gradients of the B K rows and their per-example means."""

    def __init__(self, augmentation: Augmentation):
        self.augmentation = augmentation
        self.key: int | None = None

    @property
    def k(self) -> int:
        return self.augmentation.multiplicity

    def examples_per_chunk(self, rows: int) -> int:
        """Examples of a physical chunk whose K views make at most ``rows`` rows (at least one example)."""
        return max(1, int(rows) // self.k)

    def checked(self, example) -> Multiplicity:
        """This stage, once the training inputs (``example``: one as a batch of one) are found to be images that a
        crop of ``crop_padding`` fits (a padding below the image's sides)."""
        check_images(example)
        p = self.augmentation.crop_padding
        if p >= min(example.shape[2:]):
            raise ConfigError(
                f"training.augment.crop_padding must be smaller than the image's sides {list(example.shape[2:])}, "
                f"got {p}"
            )
        return self

    def new_step(self, stream) -> None:
        """Draw the step's key from the run's augmentation stream: 256 bits for AES from the secure stream
        (``privacy.secure_noise``), else one 64-bit word."""
        from dptrain.randomness.secure import SecureStream

        if isinstance(stream, SecureStream):
            self.key = np.asarray(stream.words(4), dtype="<u8").tobytes()
        else:
            self.key = int(stream.words(1)[0])

    def __call__(self, grad_sampler, x, y: torch.Tensor, examples: torch.Tensor):
        """(per-example gradients, per-example losses) of the chunk ``x``, ``y`` of training-set indices
        ``examples``: each the mean over the example's K views."""
        if self.key is None:
            raise RuntimeError("Multiplicity.new_step must draw the step's key before the chunks")
        check_images(x)
        a, k = self.augmentation, self.k
        rows = x.repeat_interleave(k, dim=0) if k > 1 else x
        if a.transforms:
            rows = views(rows, *view_parameters(self.key, examples, a), a.crop_padding)
        labels = y.repeat_interleave(k, dim=0) if k > 1 else y
        grads, losses = grad_sampler(rows, labels)
        return mean_of_views(grads, k), (_grouped(losses, k).mean(1) if k > 1 else losses)


__all__ = [
    "AUGMENT_KEYS",
    "Augmentation",
    "Multiplicity",
    "check_fits",
    "check_images",
    "make_augmentation",
    "mean_of_views",
    "view_parameters",
    "views",
]
