"""The randomness of a run: one secret stream per purpose.

Noise, batch sampling, mixing weights and the noise of private preprocessing protect privacy: whoever can
recompute them can subtract the noise and read the clipped gradients. So by default every stream is seeded
from the operating system's CSPRNG (``secrets``), and nothing derivable from it is written to a run's
shareable outputs. Each purpose has its own stream, spawned from one root ``numpy.random.SeedSequence`` with a
fixed spawn key per purpose, so drawing more of one (say, a larger batch) never shifts another.

``seed = N`` is a reproducibility option for experiments: the streams are then a function of N, and a run
records and prints :data:`SEEDED_WARNING` (anyone who knows N can recompute the noise).

A stream's state is secret too: it lives in the run's checkpoint (see :mod:`dptrain.runs.rundir`), never beside
the shareable outputs.

Two kinds of stream implement one small interface (:class:`dptrain.randomness.streams.Stream`, also importable from here):

- :class:`TorchStream` (default): torch's Mersenne Twister, seeded with 64 secret bits. Fast; its outputs are
  never released directly (only after adding them to gradients), but it is not a cryptographic generator.
- :class:`dptrain.randomness.secure.SecureStream` (``secure_noise = true``): AES-256 in counter mode keyed with 256
  secret bits, and a Gaussian sampler hardened against floating-point attacks (docs/privacy.md).
"""

from __future__ import annotations

import hashlib
import secrets
import warnings

import numpy as np
import torch

from dptrain.errors import ConfigError
from dptrain.randomness.streams import Stream, check_state_kind

#: Purposes in a fixed order: the index is the stream's spawn key, so it must never be reordered.
PURPOSES = ("sampling", "noise", "mixing", "preprocessing", "canaries", "init", "tuning", "augmentation")
#: Streams whose predictability would void the privacy guarantee (the views of augmentation multiplicity among them:
#: the sensitivity argument couples runs on neighbouring data sets through views that are independent draws,
#: docs/recipes.md).
PRIVACY_CRITICAL = ("sampling", "noise", "mixing", "preprocessing", "tuning", "augmentation")

SEEDED_WARNING = (
    "not private: the noise can be recomputed from the seed (seed = N is for reproducible experiments only; "
    "remove it to draw the privacy-critical randomness from operating-system entropy)"
)
SECRET_DESCRIPTION = "secret (operating-system entropy; generator states only in the private checkpoint)"


class NotPrivateWarning(UserWarning):
    """A run was asked to do something that voids its privacy guarantee (e.g. an explicit seed)."""


class TorchStream:
    """A ``torch.Generator`` (Mersenne Twister) seeded with 64 bits; on an accelerator, ``add_gaussian`` draws with a
    generator of that device (seeded from the same 64 bits, Philox on CUDA), so the noise is made where the gradient
    is, and its state is checkpointed with the rest."""

    kind = "torch"

    def __init__(self, seed64: int):
        self.seed64 = int(seed64)
        self.generator = torch.Generator().manual_seed(self.seed64)
        self._device_generators: dict[str, torch.Generator] = {}

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        key = str(device)
        if key not in self._device_generators:
            self._device_generators[key] = torch.Generator(device=device).manual_seed(self.seed64)
        return self._device_generators[key]

    def uniform(self, shape, dtype=torch.float64):
        return torch.rand(shape, generator=self.generator, dtype=dtype, device="cpu")

    def normal(self, shape, dtype=torch.float32):
        return torch.randn(shape, generator=self.generator, dtype=dtype, device="cpu")

    def gaussian(self, like):
        return torch.randn(like.shape, generator=self._generator_for(like.device), dtype=like.dtype, device=like.device)

    def add_gaussian(self, x, std):
        # (std z + x, formed in the draw's own buffer: the value of x + std z, without two temporaries)
        return self.gaussian(x).mul_(std).add_(x)

    def integers(self, low, high):
        if not high > low:
            raise ValueError(f"empty range [{low}, {high})")
        return low + int(torch.randint(0, high - low, (1,), generator=self.generator, device="cpu"))

    def permutation(self, n):
        return torch.randperm(n, generator=self.generator, device="cpu")

    def words(self, count):
        # random_ over the whole int64 range (from its lowest value, no upper bound) is one 64-bit draw of the
        # generator per value, all 64 bits kept (ATen's full-range kernel): read as uint64, uniform words.
        draws = torch.empty(count, dtype=torch.int64, device="cpu").random_(-(2**63), None, generator=self.generator)
        return draws.numpy().view(np.uint64)

    def get_state(self):
        state = {"kind": self.kind, "generator": self.generator.get_state()}
        if self._device_generators:
            state["devices"] = {d: g.get_state() for d, g in self._device_generators.items()}
        return state

    def set_state(self, state):
        check_state_kind(self, state)
        self.generator.set_state(state["generator"])
        for device, device_state in state.get("devices", {}).items():
            self._generator_for(torch.device(device)).set_state(device_state)


def keyed_stream(key, secure: bool) -> Stream:
    """A stream of its own keyed by ``key``, four 64-bit words drawn from a secret stream (a search trial's held-out
    split, drawn again from the same key on resume): AES-256-CTR keyed with all 256 bits when ``secure``
    (:class:`dptrain.randomness.secure.SecureStream`), else a :class:`TorchStream` seeded with the first 64."""
    words = [int(w) for w in key]
    if len(words) != 4:
        raise ValueError(f"a stream key is four 64-bit words, got {len(words)}")
    if secure:
        from dptrain.randomness.secure import SecureStream  # only when asked for: imports cryptography

        return SecureStream(np.array(words, dtype=np.uint64).tobytes())
    return TorchStream(words[0])


def open_unit(stream: Stream) -> float:
    """One number uniform on (0, 1), never 0 or 1: (k + 1/2) 2^-53 for k a uniform 53-bit integer of ``stream``
    (for inverting a distribution function, e.g. a search's secret number of trials)."""
    return ((int(stream.words(1)[0]) >> 11) + 0.5) * 2.0**-53


def _purpose_index(purpose: str) -> int:
    try:
        return PURPOSES.index(purpose)
    except ValueError:
        raise ValueError(f"unknown randomness purpose {purpose!r}; known: {', '.join(PURPOSES)}") from None


class Randomness:
    """The streams of one run, by purpose.

    ``seed=None`` (default): 128 bits of operating-system entropy, never written anywhere but the private
    checkpoint. ``seed=N``: reproducible and NOT private (warns with :class:`NotPrivateWarning`).
    ``secure=True``: the privacy-critical purposes use :class:`~dptrain.randomness.secure.SecureStream`.
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False, warn: bool = True, entropy: int | None = None):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"seed must be an integer >= 0 (or absent for secret randomness), got {seed!r}")
        self.seeded = seed is not None
        self.secure = bool(secure)
        # ``entropy``: 128 secret bits drawn elsewhere (rank 0 of a data-parallel run shares its own)
        self._entropy = int(seed) if seed is not None else (int(entropy) if entropy is not None else secrets.randbits(128))
        self._streams: dict[str, Stream] = {}
        if self.seeded and warn:
            warnings.warn(SEEDED_WARNING, NotPrivateWarning, stacklevel=2)

    @property
    def description(self) -> str:
        """How the run's randomness was drawn, for summaries (never the seed or any state)."""
        base = "seeded: " + SEEDED_WARNING if self.seeded else SECRET_DESCRIPTION
        return base + ("; secure noise (AES-256-CTR)" if self.secure else "")

    def _seed_sequence(self, purpose: str) -> np.random.SeedSequence:
        return np.random.SeedSequence(self._entropy, spawn_key=(_purpose_index(purpose),))

    def stream(self, purpose: str) -> Stream:
        """The stream of ``purpose`` (created on first use, then the same object)."""
        if purpose not in self._streams:
            seq = self._seed_sequence(purpose)
            if self.secure and purpose in PRIVACY_CRITICAL:
                from dptrain.randomness.secure import (
                    SecureStream,  # only when asked for: imports cryptography
                )

                self._streams[purpose] = SecureStream(seq.generate_state(8, np.uint32).tobytes())
            else:
                self._streams[purpose] = TorchStream(int(seq.generate_state(1, np.uint64)[0]))
        return self._streams[purpose]

    def derived_key(self, purpose: str) -> bytes:
        """32 secret bytes for ``purpose``, a keyed hash (BLAKE2b) of the run's entropy: the same for the whole run and
        across resumes, for decisions that must be a fixed secret function of the step (the sentinel's), not draws of a
        stream that an error rolls back. Never written anywhere."""
        entropy = self._entropy.to_bytes((max(self._entropy.bit_length(), 1) + 7) // 8, "little")
        return hashlib.blake2b(entropy, digest_size=32, person=b"dptrain-key", salt=purpose.encode()[:16]).digest()

    def seed_torch(self, purpose: str = "init") -> None:
        """Seed torch's global generator (model initialization, dropout) from ``purpose``'s sequence."""
        torch.manual_seed(int(self._seed_sequence(purpose).generate_state(1, np.uint64)[0]))

    # -- checkpoints (secret) ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue the same streams: SECRET, for the private checkpoint only."""
        return {
            "entropy": format(self._entropy, "x"),
            "seeded": self.seeded,
            "secure": self.secure,
            "streams": {p: s.get_state() for p, s in self._streams.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("secure")) != self.secure:
            raise ConfigError(
                "the checkpoint was written with privacy.secure_noise = "
                f"{str(bool(state.get('secure'))).lower()}; a run cannot change it when resumed"
            )
        self._entropy = int(state["entropy"], 16)
        # (a label is never lifted: streams made from a seed stay seeded, whatever a checkpoint says)
        self.seeded = self.seeded or bool(state["seeded"])
        self._streams = {}
        for purpose, stream_state in state["streams"].items():
            self.stream(purpose).set_state(stream_state)
