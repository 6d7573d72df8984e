"""A cryptographically secure stream for privacy-critical randomness (``privacy.secure_noise = true``).

Uniform bits: AES-256 in counter mode (``cryptography``), keyed with 256 bits spawned from the run's secret
entropy, the counter starting at 0 and advancing by one per 16-byte block. Its state is the key and the
number of blocks used: a checkpoint continues the same stream exactly. Without the key the stream cannot be
predicted from its outputs (unlike a Mersenne Twister, whose state follows from 624 outputs).

Gaussian noise, hardened against floating-point attacks. A floating-point sampler can output only some
floats, unevenly spaced; seeing x + Z, an attacker can test which candidate x leaves a difference that the
sampler could have produced (Mironov 2012 for the Laplace mechanism; Jin et al. 2022 for Gaussian
samplers). We make the support of the released value dense and independent of x:

1. each standard normal is built from two 53-bit uniforms by the Box-Muller transform in float64 (every
   pair yields two normals);
2. the noise is the sum of four such normals divided by two (unit variance): a sum of independent draws
   fills the gaps of one draw's support (Holohan & Braghin 2021, "Secure Random Sampling in Differential
   Privacy"; the same construction as Opacus' secure mode);
3. the noise is added in float64 and the result rounded ONCE to the parameter dtype (float32 by default),
   whose resolution is 2^29 times coarser than float64's: what is released is a float32 rounding of a float64
   value, not the float64 noise itself.

This is a mitigation with a written argument, not a proof: an exact guarantee would need the discrete
Gaussian on a grid (Canonne, Kamath & Steinke 2020), with the extra sensitivity of rounding the gradient
to the grid in the accounting. Timing side channels are out of scope. docs/privacy.md says the same.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dptrain.randomness.streams import check_state_kind

_TWO_PI = 2.0 * math.pi
_2_POW_M53 = 2.0**-53
#: Independent normals summed per noise value (their sum is divided by sqrt(this) = 2).
SUMMED_DRAWS = 4


class SecureStream:
    """AES-256-CTR stream with the :class:`dptrain.randomness.streams.Stream` interface."""

    kind = "secure"

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("SecureStream needs a 32-byte (AES-256) key")
        self._key = bytes(key)
        self._blocks = 0  # 16-byte blocks consumed so far (the CTR counter of the next one)

    # -- raw material --------------------------------------------------------------------------------------
    def words(self, count: int) -> np.ndarray:
        """``count`` independent uniform 64-bit words."""
        blocks = (8 * count + 15) // 16
        counter = (self._blocks % 2**128).to_bytes(16, "big")
        encryptor = Cipher(algorithms.AES(self._key), modes.CTR(counter)).encryptor()
        data = encryptor.update(bytes(16 * blocks))
        self._blocks += blocks
        return np.frombuffer(data, dtype=np.uint64, count=count)

    def _unit(self, count: int, open_at_zero: bool = False) -> torch.Tensor:
        """float64 uniforms k * 2^-53: on [0, 1), or on (0, 1] with ``open_at_zero``."""
        k = torch.from_numpy((self.words(count) >> np.uint64(11)).astype(np.float64))
        return (k + 1.0 if open_at_zero else k) * _2_POW_M53

    def _normals64(self, count: int) -> torch.Tensor:
        """``count`` standard normals, float64, Box-Muller (two per pair of uniforms; torch's vectorized math)."""
        pairs = (count + 1) // 2
        radius = torch.sqrt(-2.0 * torch.log(self._unit(pairs, open_at_zero=True)))
        angle = _TWO_PI * self._unit(pairs)
        return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]

    def _noise64(self, count: int) -> torch.Tensor:
        """Unit-variance noise as the sum of SUMMED_DRAWS normals / sqrt(SUMMED_DRAWS) (module docstring)."""
        draws = self._normals64(SUMMED_DRAWS * count).reshape(SUMMED_DRAWS, count)
        return draws.sum(0) / math.sqrt(SUMMED_DRAWS)

    # -- the Stream interface ------------------------------------------------------------------------------
    def uniform(self, shape, dtype=torch.float64):
        n = math.prod(shape) if isinstance(shape, tuple | list) else int(shape)
        return self._unit(n).reshape(shape).to(dtype)

    def normal(self, shape, dtype=torch.float32):
        n = math.prod(shape) if isinstance(shape, tuple | list) else int(shape)
        return self._noise64(n).reshape(shape).to(dtype)

    def gaussian(self, like):
        # float64 whatever like's dtype: the noise is added in float64 and the sum rounded once (module docstring)
        return self._noise64(like.numel()).reshape(like.shape).to(like.device)

    def add_gaussian(self, x, std):
        return (x.to(torch.float64) + std * self.gaussian(x)).to(x.dtype)

    def integers(self, low, high):
        span = high - low
        if not span > 0:
            raise ValueError(f"empty range [{low}, {high})")
        if span > 2**64:
            raise ValueError("SecureStream.integers covers ranges up to 2^64")
        limit = 2**64 - (2**64 % span)  # rejection sampling: no modulo bias
        while True:
            w = int(self.words(1)[0])
            if w < limit:
                return low + w % span

    def permutation(self, n):
        # Sorting independent 64-bit keys: uniform up to ties (probability < n^2 / 2^65), broken by index.
        return torch.from_numpy(np.argsort(self.words(n), kind="stable")).to(torch.int64)

    def get_state(self):
        return {
            "kind": self.kind,
            "key": torch.frombuffer(bytearray(self._key), dtype=torch.uint8).clone(),
            "blocks": int(self._blocks),
        }

    def set_state(self, state):
        check_state_kind(self, state)
        self._key = bytes(state["key"].tolist())
        self._blocks = int(state["blocks"])
