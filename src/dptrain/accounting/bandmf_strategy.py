"""The coefficients of banded matrix factorization (BandMF): the banded Toeplitz C that minimizes the error of a
workload, in O(T b) per objective and gradient (O(T log T) for a general workload). numpy/scipy only.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023). The training run estimates a workload A x of its gradients x (the
iterates of SGD are the prefix sums A = S of the gradients) from the noisy releases C x + z: the model's error is
A C^{-1} z, whose total variance at unit noise is ||A C^{-1}||_F^2, and the noise needed for a privacy budget scales
with the sensitivity of C (its largest column norm, for the participation of BandMF: see
:mod:`dptrain.accounting.bandmf_sensitivity`). The quantity minimized is the paper's loss of a strategy:

    E(c) = sens(C)^2 ||A C^{-1}||_F^2,   sens(C) = ||c||_2,

over lower-triangular Toeplitz C with b bands, given by its first column c_0..c_{b-1} (c_0 > 0). E is invariant under
c -> s c, so the unconstrained minimum is normalized to ||c|| = 1 (the noise then has the DP-SGD multiplier).

Structure used (every matrix here is T x T lower-triangular Toeplitz, so they commute, and each is its first column):

- u = C^{-1} e_0, the first column of C^{-1}: the recurrence u_t = (1[t = 0] - sum_{j=1}^{b-1} c_j u_{t-j}) / c_0 (a
  linear filter, scipy.signal.lfilter);
- v = A u, the first column of A C^{-1}; ||A C^{-1}||_F^2 = sum_k (T - k) v_k^2 (column k of a lower-triangular
  Toeplitz matrix holds v_0..v_{T-1-k});
- dE/dc_j: with g = sum_k w_k v_k^2 (w_k = T - k), du/dc_j = -C^{-1} Z^j u (Z the shift), so
  dg/dc_j = -2 (A^T (w v))^T C^{-1} Z^j u = -2 sum_m s_m h_{m+j}, with s = C^{-1} u = u * u (a power-series square)
  and h = A^T (w v) (A^T is A flipped: A^T y = J A J y). Then dE/dc = 2 c g + ||c||^2 dg/dc.

The prefix-sum and momentum workloads are rational (A = 1/(1 - x), 1/((1 - x)(1 - beta x)) as power series), so
A u and A^T y cost O(T); a general Toeplitz workload uses FFTs. Inside the optimizer, u is computed until it has
decayed below 1e-18 of its peak (the tail is then zero to double precision); :func:`workload_error` computes the
full length.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import fft, optimize, signal

from dptrain.errors import AccountingError

#: The largest number of bands the optimizer takes (b - 1 noise vectors of the model's size are the engine's state).
MAX_BANDS = 4096
#: The most steps the coefficients are optimized (and their error computed) for: the objective holds vectors of T
#: doubles (about 0.55 GB at the peak of ``dptrain account --bands 4`` at 10^7 steps; 10^9 steps would need ~50 GB).
MAX_STEPS = 10**7


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """sum_i x_i y_i by numpy's pairwise summation, never BLAS: OpenBLAS splits a long dot product over its threads,
    so its last bits depend on how many there are, and so would the optimized coefficients (T = 20000, b = 64: other
    bits with 1 and 2 threads). The coefficients are a public number of the run, recorded in its ledger: a run resumed
    on another machine or under torchrun (one thread per rank) must compute the same ones, or its checkpoint is
    refused."""
    return float(np.multiply(x, y).sum())


# --- workloads ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A lower-triangular Toeplitz workload matrix A (what the training run estimates from its noisy gradients),
    given by its first column: ``prefix`` sums (a_k = 1: SGD's iterates), SGD with ``momentum`` beta
    (a_k = (1 - beta^{k+1}) / (1 - beta): the iterates of theta_t = theta_{t-1} - eta m_t, m_t = beta m_{t-1} + g_t,
    the paper's momentum workload), or any ``toeplitz`` first column (zeros beyond its length).

    Learning-rate schedules are not modelled. A schedule eta_t makes the workload S diag(eta) M, which is not
    Toeplitz: A C^{-1} loses the structure that gives the O(T b) objective, and the optimum would depend on the
    whole schedule. The privacy of a run does not depend on A (the released gradients are post-processing of
    C x + z), so a run with a schedule may use these coefficients: it is exactly as private, and its noise is
    optimal for the constant-rate workload rather than for its own."""

    kind: str = "prefix"
    momentum: float = 0.0
    column: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("prefix", "momentum", "toeplitz"):
            raise AccountingError(f"workload must be prefix, momentum or toeplitz, got {self.kind!r}")
        beta = self.momentum
        if self.kind == "momentum" and (isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 1):
            raise AccountingError(f"the momentum of a workload must be a number in [0, 1), got {beta!r}")
        if self.kind == "toeplitz":
            col = np.asarray(self.column, dtype=float)
            if col.ndim != 1 or col.size == 0 or not np.all(np.isfinite(col)) or not np.any(col):
                raise AccountingError("a toeplitz workload needs a non-empty, finite, non-zero first column")

    def first_column(self, steps: int) -> np.ndarray:
        """a_0..a_{steps-1}."""
        e0 = np.zeros(steps)
        e0[0] = 1.0
        return self.apply(e0)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """A x for the len(x) x len(x) workload (the power-series product a * x, truncated)."""
        if self.kind == "prefix":
            return np.cumsum(x)
        if self.kind == "momentum":
            return np.cumsum(signal.lfilter([1.0], [1.0, -self.momentum], x))
        col = np.zeros(len(x))
        n = min(len(x), len(self.column))
        col[:n] = self.column[:n]
        size = fft.next_fast_len(2 * len(x))
        return fft.irfft(fft.rfft(col, size) * fft.rfft(x, size), size)[: len(x)]

    def apply_transpose(self, y: np.ndarray) -> np.ndarray:
        """A^T y: A^T = J A J for a Toeplitz A (J reverses the order)."""
        return self.apply(y[::-1])[::-1]

    def frobenius_squared(self, steps: int) -> float:
        """||A||_F^2 = sum_k (T - k) a_k^2: DP-SGD's error (C = I)."""
        a = self.first_column(steps)
        return _dot(steps - np.arange(steps), a * a)


PREFIX_SUMS = Workload("prefix")


def momentum_workload(beta: float) -> Workload:
    """SGD with momentum ``beta`` (heavy ball, constant learning rate)."""
    return Workload("momentum", momentum=beta)


def toeplitz_workload(first_column) -> Workload:
    """Any lower-triangular Toeplitz workload, by its first column."""
    return Workload("toeplitz", column=tuple(float(a) for a in np.ravel(first_column)))


# --- the objective ----------------------------------------------------------------------------------------------


def check_coefficients(coefficients, key: str = "BandMF coefficients") -> np.ndarray:
    """``coefficients`` as a float array c_0..c_{b-1}, or a one-line refusal: a finite non-empty vector with c_0 > 0
    (C must be invertible for the noise C^{-1} z; the sign is the convention of the paper's normalization)."""
    try:
        c = np.asarray(coefficients, dtype=float)
    except (TypeError, ValueError):
        raise AccountingError(f"{key} must be a vector of numbers, got {coefficients!r}") from None
    if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
        raise AccountingError(
            f"{key} must be a non-empty vector of finite numbers with c_0 > 0 (C is then invertible), got "
            f"{np.array2string(np.atleast_1d(c)[:4], precision=4)}{'...' if c.size > 4 else ''}"
        )
    return c


def check_steps(steps: int, key: str = "steps") -> int:
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise AccountingError(f"{key} must be an integer >= 1, got {steps!r}")
    return int(steps)


def check_horizon(steps: int) -> int:
    """``steps`` for the objective, whose vectors hold T doubles: at most MAX_STEPS, else a one-line refusal (not a
    memory error)."""
    steps = check_steps(steps)
    if steps > MAX_STEPS:
        raise AccountingError(
            f"BandMF's coefficients are optimized over every step of the run, in memory: at most {MAX_STEPS:.0e} steps "
            f"(about 60 bytes a step), got {steps}"
        )
    return steps


def inverse_column(coefficients, steps: int) -> np.ndarray:
    """u = C^{-1} e_0 (length ``steps``): the first column of C^{-1}, which is lower-triangular Toeplitz, by the
    recurrence u_t = (1[t = 0] - sum_{j>=1} c_j u_{t-j}) / c_0 (Choquette-Choo et al., "(Amplified) Banded Matrix
    Factorization", the streamed noise of Algorithm 9 applied to e_0)."""
    c, steps = check_coefficients(coefficients), check_horizon(steps)
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        return signal.lfilter([1.0], c, impulse)


def workload_error(coefficients, steps: int, workload: Workload = PREFIX_SUMS) -> float:
    """E(c) = ||c||^2 ||A C^{-1}||_F^2: the total variance of the noisy workload A C^{-1} z at unit noise, with the
    sensitivity of C (its column norm ||c||, :mod:`dptrain.accounting.bandmf_sensitivity`) normalized to 1
    (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", the loss sens(C)^2 ||A C^{-1}||_F^2 their
    banded strategies minimize, Sec. 3-4). c = [1] (DP-SGD) gives ||A||_F^2. Infinite when C^{-1} overflows."""
    c, steps = check_coefficients(coefficients), check_horizon(steps)
    c = c[:steps]
    u = inverse_column(c, steps)
    if not np.all(np.isfinite(u)):
        return math.inf
    with np.errstate(over="ignore", invalid="ignore"):
        v = workload.apply(u)
        value = _dot(c, c) * _dot(steps - np.arange(steps), v * v)
    return value if math.isfinite(value) else math.inf


#: Inside the optimizer u is computed until it stays below this fraction of its peak (zero in double precision).
_DECAYED = 1e-18
#: Beyond this, C^{-1} is taken to overflow (C far from minimum phase: not an optimum).
_GROWTH = 1e100


def _inverse_until_decayed(c: np.ndarray, steps: int) -> np.ndarray | None:
    """u = C^{-1} e_0 computed in growing chunks until it has decayed (its last b values and the filter's state
    below _DECAYED of its peak: then every later value is too) or reached ``steps``; None if it grows past
    _GROWTH. Same recurrence as :func:`inverse_column`."""
    chunks, state, done, peak, size = [], np.zeros(len(c) - 1), 0, 0.0, max(1024, 4 * len(c))
    while done < steps:
        n = min(size, steps - done)
        x = np.zeros(n)
        if done == 0:
            x[0] = 1.0
        with np.errstate(over="ignore", invalid="ignore"):
            y, state = signal.lfilter([1.0], c, x, zi=state)
        top = float(np.max(np.abs(y)))
        if not top < _GROWTH:
            return None
        chunks.append(y)
        done, peak, size = done + n, max(peak, top), 2 * size
        tail = max(float(np.max(np.abs(y[-len(c) :]))), float(np.max(np.abs(state), initial=0.0)))
        if tail <= _DECAYED * peak:
            break
    return np.concatenate(chunks)


def error_and_gradient(coefficients, steps: int, workload: Workload = PREFIX_SUMS) -> tuple[float, np.ndarray]:
    """(E(c), dE/dc) of :func:`workload_error` (the derivation is in the module's docstring): O(T b) for the
    recurrence, O(T) for a rational workload, O(T log T) for the FFTs. (inf, 0) when C^{-1} overflows."""
    c, steps = check_coefficients(coefficients), check_horizon(steps)
    b = len(c)
    if b > steps:
        raise AccountingError(f"a {b}-band C for {steps} steps: the bands must be at most the steps")
    u = _inverse_until_decayed(c, steps)
    if u is None:
        return math.inf, np.zeros(b)
    n = len(u)
    full = np.zeros(steps)
    full[:n] = u
    v = workload.apply(full)
    weights = steps - np.arange(steps, dtype=float)
    g = _dot(weights, v * v)
    h = workload.apply_transpose(weights * v)
    # s = u * u (power series), exact up to 2n - 1 terms of the decayed u; correlation sum_m s_m h_{m+j}, j < b.
    reach = min(steps, 2 * n - 1)
    size = fft.next_fast_len(2 * n - 1)
    s = fft.irfft(fft.rfft(u, size) ** 2, size)[:reach]
    size = fft.next_fast_len(reach + b)
    hh = np.zeros(reach + b)
    m = min(steps, reach + b)
    hh[:m] = h[:m]
    corr = fft.irfft(fft.rfft(hh, size) * np.conj(fft.rfft(s, size)), size)[:b]
    norm2 = _dot(c, c)
    return norm2 * g, 2.0 * c * g + norm2 * (-2.0 * corr)


# --- the optimum ------------------------------------------------------------------------------------------------


def square_root_coefficients(bands: int, workload: Workload = PREFIX_SUMS) -> np.ndarray:
    """The first ``bands`` coefficients of the power-series square root of the workload, normalized: the banded
    square root (Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
    Training", NeurIPS 2024), for prefix sums binom(2k, k) / 4^k. The optimizer's starting point (e_0 when
    a_0 <= 0)."""
    a = workload.first_column(bands)  # the leading b x b block of A has the same first b coefficients
    if not a[0] > 0:
        return np.eye(bands)[0]
    r = np.zeros(bands)
    r[0] = math.sqrt(a[0])
    for k in range(1, bands):
        r[k] = (a[k] - _dot(r[1:k], r[k - 1 : 0 : -1])) / (2 * r[0])
    if not (np.all(np.isfinite(r)) and r[0] > 0):
        return np.eye(bands)[0]
    return r / math.sqrt(_dot(r, r))


@functools.lru_cache(maxsize=256)
def _optimal(steps: int, bands: int, workload: Workload) -> tuple[float, ...]:
    if bands == 1:
        return (1.0,)
    start = square_root_coefficients(bands, workload)
    scale = workload.frobenius_squared(steps)  # E of DP-SGD: the objective is O(1) for L-BFGS

    def objective(x):
        e, grad = error_and_gradient(x, steps, workload)
        return (e / scale, grad / scale) if math.isfinite(e) else (1e30, np.zeros_like(x))

    # E is scale-invariant, so the start's radius only sets how large L-BFGS's first trial step (unit length) is
    # relative to c: at radius 10 a tenth of ||c||, small enough to stay where C^{-1} does not overflow.
    result = optimize.minimize(
        objective,
        10.0 * start,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 500, "ftol": 1e-12, "gtol": 1e-10},
    )
    c = result.x / (np.sign(result.x[0]) * math.sqrt(_dot(result.x, result.x)))
    if not (np.all(np.isfinite(c)) and c[0] > 0 and workload_error(c, steps, workload) <= workload_error(start, steps, workload)):
        c = start
    return tuple(float(x) for x in c)


def optimal_coefficients(steps: int, bands: int, workload: Workload = PREFIX_SUMS) -> np.ndarray:
    """The unit-norm c (c_0 > 0, length ``bands``) minimizing E(c) = ||c||^2 ||A C^{-1}||_F^2 (Choquette-Choo et al.,
    "(Amplified) Banded Matrix Factorization", the banded strategy optimization of Sec. 4 restricted, as their code
    does for large T, to Toeplitz C): L-BFGS from the banded square root with the analytic gradient of
    :func:`error_and_gradient`. bands = 1 is DP-SGD: c = [1]. Memoized: about a second at T = 1e5, b = 256.

    The optimum is for a constant learning rate (see :class:`Workload` for schedules)."""
    steps = check_steps(steps)
    bands = check_steps(bands, "bands")
    if bands > 1:  # (one band is DP-SGD, c = [1], at any length)
        check_horizon(steps)
    if bands > min(steps, MAX_BANDS):
        raise AccountingError(
            f"bands must be at most the steps ({steps}) and at most {MAX_BANDS} (the noise state is b - 1 vectors "
            f"of the model's size), got {bands}"
        )
    if not isinstance(workload, Workload):
        raise AccountingError(f"workload must be a Workload (prefix sums, momentum or toeplitz), got {workload!r}")
    return np.array(_optimal(steps, bands, workload))
