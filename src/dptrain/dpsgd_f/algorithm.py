"""DPSGD-F: private feature preprocessing before DP-SGD on a linear model.

Sun, Suresh & Menon, "The importance of feature preprocessing for differentially private linear
optimization" (ICLR 2024; docs/dpsgd_f.md). DP-SGD on raw
features can lose accuracy in proportion to the largest feature norm (Sec. 4, Theorem 3); centering the
features privately first makes the leading error depend on the data's diameter instead (Theorem 1).

Two pipelines, both recorded in one privacy ledger together with the DP-SGD steps that follow:

``private_mean`` (Algorithm 3, App. C: what the paper's experiments run)
    1. normalize every feature vector to norm C_F (data-independent: free);
    2. mu_hat = (sum_i x_i + N(0, (sigma_F C_F)^2 I)) / n, sigma_F the analytic-Gaussian multiplier for
       (eps_F, delta) (Balle & Wang 2018). The sum has L2 sensitivity C_F under add/remove adjacency; n is
       treated as public, as the engine's Poisson normalization already does. The paper's Algorithm 3 prints
       the noise without the 1/n (docs/dpsgd_f.md, deviations): we divide, otherwise the estimate would be useless;
    3. x_i <- x_i - mu_hat, then DP-SGD (gradient clipping) on the translated features, with its noise
       calibrated so that the COMPOSITION of the mean and all steps meets the total (epsilon, delta) (the
       paper uses PLD: Lemma 9);
    4. the bias is mapped back, b = b' - W' mu_hat, so the returned model applies to normalized raw features.

``dpsgd_f_theory`` (Algorithm 2, Sec. 5), each phase at (eps/3, delta/3), certified by basic composition:
    1. private mean (deviation: the Gaussian mechanism on C_F-normalized features, not Huang et al.'s
       instance-optimal estimator, which the paper does not restate; so Theorem 1's diameter-only error does
       not formally carry over: docs/dpsgd_f.md);
    2. tau = a private quantile of the distances ||x_i - mu_hat|| by the exponential mechanism over a grid of
       step alpha = R/n^2 (App. B.2 with Dick et al. 2023), target rank n - (100/eps) ln n, then tau + alpha
       (deviation: ties are broken by U[0, R/n) jitter per distance, see :func:`exponential_quantile`);
    3. x'_i = (x_i - mu_hat, tau) (Lemma 5), clipped to norm sqrt(2) tau (Lemma 7);
    4. DP-SGD without bias and with clip norm sqrt(2) G tau, G = sqrt(2) the Lipschitz constant of softmax
       cross-entropy in the scores (so no gradient is clipped: Sec. 5, step 5);
    5. w = theta[:d], b = tau theta[d] - w . mu_hat (the paper's step 6 prints "- mu_hat", a typo: docs/dpsgd_f.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dptrain.accounting import (
    Ledger,
    calibrate_noise,
    gaussian_mechanism_noise,
    gaussian_step_event,
    step_facts,
)
from dptrain.data.loaders import ArrayDataset, DataSplit, as_tensors
from dptrain.dpsgd_f.config import KINDS
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import ConfigError, DataError, ModelError
from dptrain.randomness.generators import Randomness, Stream

#: ||grad of softmax cross-entropy w.r.t. the scores||_2 = ||p - e_y||_2 <= sqrt(2): the G of Sec. 2 / Sec. 5.
SOFTMAX_LIPSCHITZ = math.sqrt(2.0)


# --- feature maps -----------------------------------------------------------------------------------------


def flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(len(x), -1)


def normalize_features(x: torch.Tensor, feature_norm: float) -> torch.Tensor:
    """x_i <- x_i C_F / ||x_i|| (App. C, applied before both DPSGD and DPSGD-F). Per example and fixed in
    advance, so it costs no privacy. An all-zero row stays zero (its norm, 0, is still <= C_F)."""
    x = flatten(x)
    norms = x.norm(dim=1, keepdim=True)
    return x * torch.where(norms > 0, feature_norm / norms.clamp_min(1e-30), torch.zeros_like(norms))


def clip_rows(x: torch.Tensor, bound: float) -> torch.Tensor:
    """Clip(x, C) = min(1, C / ||x||) x for every row (Sec. 2)."""
    norms = x.norm(dim=1, keepdim=True)
    return x * torch.clamp(bound / norms.clamp_min(1e-30), max=1.0)


# --- the two private statistics ---------------------------------------------------------------------------


def private_mean(
    x: torch.Tensor, noise_multiplier: float, sensitivity: float, stream: Stream
) -> torch.Tensor:
    """(sum_i x_i + N(0, (noise_multiplier * sensitivity)^2 I)) / n, for rows of norm <= ``sensitivity``; the noise
    comes from the run's secret "preprocessing" stream."""
    x = flatten(x).to(torch.float64)
    return (stream.add_gaussian(x.sum(0), noise_multiplier * sensitivity) / len(x)).to(torch.float32)


def exponential_quantile(
    values: np.ndarray,
    rank: float,
    epsilon: float,
    upper: float,
    grid_step: float,
    stream: Stream,
    tie_break: float = 0.0,
) -> float:
    """The exponential mechanism (McSherry & Talwar 2007) over the grid {0, a, 2a, ..., upper}, a = grid_step:
    P[t] ~ exp(epsilon u(t) / 2) with u(t) = -|#{i : v_i <= t} - rank|. Adding or removing one value changes u
    by at most 1, so the output is epsilon-DP (pure). Sampled exactly without listing the grid: u is constant
    between consecutive sorted values, so an interval is drawn first (weight: its grid points times its
    exp-utility), then a grid point uniformly inside it.

    With probability >= 1 - zeta the output's rank error exceeds the best grid point's by at most
    2 ln(N / zeta) / epsilon, N the number of grid points (:func:`quantile_rank_error`).

    ``tie_break`` > 0 adds independent U[0, tie_break) noise to every value first. Without it, data with atoms
    (e.g. all distances equal to two values) may have no threshold whose count is near ``rank``; the best utility
    is then reached on a long plateau up to ``upper``, and the output lands anywhere on it. The jitter is drawn per
    example and independently of the data, so adding or removing one value still changes every count by at most
    1: the mechanism stays epsilon-DP.

    Every draw comes from ``stream`` (the run's secret "preprocessing" stream)."""
    if not (epsilon > 0 and grid_step > 0 and upper >= 0):
        raise ConfigError("the private quantile needs epsilon > 0, a grid step > 0 and an upper end >= 0")
    v = np.asarray(values, dtype=np.float64)
    if tie_break > 0:
        v = v + tie_break * stream.uniform(v.shape).numpy()
    v = np.sort(np.clip(v, 0.0, upper))
    last = int(math.floor(upper / grid_step))  # grid points k = 0..last
    # Interval j holds the grid points t with exactly j values <= t: k from first[j] to first[j+1] - 1.
    first = np.concatenate(([0], np.ceil(v / grid_step - 1e-12).astype(np.int64), [last + 1]))
    first = np.clip(np.maximum.accumulate(first), 0, last + 1)
    points = np.diff(first)
    counts = np.arange(len(points))
    with np.errstate(divide="ignore"):
        logw = np.log(points.astype(np.float64)) - 0.5 * epsilon * np.abs(counts - rank)
    # Gumbel-max: -log(-log U) are standard Gumbel variables, and the argmax is a draw from the normalized weights.
    with np.errstate(divide="ignore"):
        g = logw - np.log(-np.log(stream.uniform((len(logw),)).numpy()))
    j = int(np.argmax(np.where(points > 0, g, -np.inf)))
    k = stream.integers(int(first[j]), int(first[j + 1]))
    return k * grid_step


def quantile_rank_error(epsilon: float, grid_points: int, failure: float) -> float:
    """Rank error the exponential mechanism exceeds with probability <= ``failure``, beyond the best grid point's:
    2 ln(N / failure) / epsilon (McSherry & Talwar Thm 8; App. B.2's (6/eps) ln(n^2/zeta) at eps/3)."""
    return 2.0 * math.log(grid_points / failure) / epsilon


def default_quantile_tail(epsilon: float, n: int) -> int:
    """Points left above tau: (100/eps) ln n (App. B.2, target rank r = n - (100/eps) log n). A proof constant;
    override it (preprocessing.quantile_tail) on small data."""
    return math.ceil(100.0 / epsilon * math.log(n))


# --- the fitted preprocessing -----------------------------------------------------------------------------


@dataclass
class FeaturePreprocessing:
    """The released preprocessing: what a model trained after it needs to see new data. ``mean`` and ``tau`` are
    private outputs (noisy), safe to publish with the model."""

    kind: str
    feature_norm: float | None
    mean: torch.Tensor | None = None
    tau: float | None = None
    noise_multiplier: float | None = None  # sigma_F of the private mean
    eps_f: float | None = None

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Raw examples -> the features the linear model is trained on."""
        z = flatten(x).to(torch.float32)
        if self.feature_norm is not None:
            z = normalize_features(z, self.feature_norm)
        if self.mean is not None:
            z = z - self.mean
        if self.tau is not None:
            z = clip_rows(torch.cat([z, torch.full((len(z), 1), self.tau)], 1), math.sqrt(2.0) * self.tau)
        return z

    def raw_model(self, model: nn.Module) -> RawFeatureLinear:
        """The trained linear model mapped back to raw (normalized) features: same predictions on raw inputs as the
        trained model on preprocessed ones (exactly for ``private_mean``; for ``dpsgd_f_theory`` the scores of a
        clipped row differ by a positive factor, so the predicted class is the same)."""
        layer = linear_layer(model, self.kind)
        weight = (
            layer.weight.detach().double()
        )  # float64 for the mapping: W mu_hat can be large (offset data)
        bias = (
            torch.zeros(weight.shape[0], dtype=torch.float64)
            if layer.bias is None
            else layer.bias.detach().double()
        )
        if self.tau is not None:  # Alg. 2 step 6: w = theta[:d], b = tau theta[d] (+ the mean term below)
            weight, bias = weight[:, :-1].clone(), bias + self.tau * weight[:, -1]
        if self.mean is not None:  # Alg. 3 return line: b = b' - W' mu_hat
            bias = bias - weight @ self.mean.double()
        return RawFeatureLinear(weight.float(), bias.float(), self.feature_norm)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "feature_norm": self.feature_norm,
            "mean": None if self.mean is None else self.mean.tolist(),
            "tau": self.tau,
            "noise_multiplier": self.noise_multiplier,
            "eps_f": self.eps_f,
        }

    @classmethod
    def from_dict(cls, data: dict) -> FeaturePreprocessing:
        mean = data.get("mean")
        return cls(
            data["kind"],
            data.get("feature_norm"),
            None if mean is None else torch.tensor(mean, dtype=torch.float32),
            data.get("tau"),
            data.get("noise_multiplier"),
            data.get("eps_f"),
        )


class RawFeatureLinear(nn.Module):
    """x -> W normalize(x) + b: the model a DPSGD-F run returns, for raw examples of any shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, feature_norm: float | None):
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)
        self.feature_norm = feature_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = flatten(x)
        return self.linear(normalize_features(z, self.feature_norm) if self.feature_norm is not None else z)


def linear_layer(model: nn.Module, kind: str = "private_mean") -> nn.Linear:
    """The single Linear layer of a linear model (Flatten + Linear, e.g. model "logistic"), or a one-line error:
    mapping the bias back (Lemma 5) is defined for linear models only."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    others = [
        type(m).__name__
        for m in model.modules()
        if not isinstance(m, nn.Linear | nn.Flatten | nn.Identity) and list(m.children()) == []
    ]
    if len(linears) != 1 or others:
        raise ModelError(
            f"preprocessing kind {kind!r} needs a linear model (Flatten + one Linear, e.g. model.name = "
            f'"logistic"), got {type(model).__name__} with {len(linears)} Linear layer(s)'
            + (f" and {', '.join(sorted(set(others)))}" if others else "")
        )
    return linears[0]


# --- fitting: the private releases, recorded in the ledger ------------------------------------------------


def fit_preprocessing(
    x: torch.Tensor,
    kind: str,
    feature_norm: float | None,
    ledger: Ledger,
    *,
    delta: float,
    eps_f: float | None = None,
    epsilon: float | None = None,
    quantile_tail: int | None = None,
    stream: Stream,
) -> FeaturePreprocessing:
    """Fit ``kind`` on the training examples ``x``, recording every private release in ``ledger``.

    ``private_mean`` spends ``eps_f`` (sigma_F calibrated at (eps_f, delta), Alg. 3); ``dpsgd_f_theory`` spends
    (epsilon/3, delta/3) on the mean and epsilon/3 on the quantile (Alg. 2); ``none`` only normalizes (if
    ``feature_norm`` is given) and releases nothing."""
    import dp_accounting as dpa

    if kind not in KINDS:
        raise ConfigError(f"preprocessing.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if feature_norm is not None and not (feature_norm > 0 and math.isfinite(feature_norm)):
        raise ConfigError(f"preprocessing.feature_norm (C_F) must be a finite number > 0, got {feature_norm}")
    if kind == "none":
        return FeaturePreprocessing(kind, feature_norm)
    if feature_norm is None:
        raise ConfigError(
            f"preprocessing kind {kind!r} needs preprocessing.feature_norm (C_F): the mean's sensitivity"
        )
    z = normalize_features(x, feature_norm)
    n = len(z)
    if kind == "private_mean":
        if eps_f is None or not eps_f > 0:
            raise ConfigError(
                f"preprocessing.eps_f must be a number > 0 for kind 'private_mean', got {eps_f}"
            )
        sigma_f = gaussian_mechanism_noise(eps_f, delta)
        mean = private_mean(z, sigma_f, feature_norm, stream)
        ledger.record(
            dpa.GaussianDpEvent(sigma_f),
            {
                "mechanism": "private_mean",
                "noise_multiplier": sigma_f,
                "sensitivity": feature_norm,
                "dataset_size": n,
            },
        )
        return FeaturePreprocessing(kind, feature_norm, mean, None, sigma_f, eps_f)
    # Algorithm 2: three phases at (epsilon/3, delta/3) each.
    if epsilon is None:
        raise ConfigError(
            "preprocessing kind 'dpsgd_f_theory' needs the total privacy.target_epsilon (split in thirds)"
        )
    eps3, delta3 = epsilon / 3, delta / 3
    sigma_m = gaussian_mechanism_noise(eps3, delta3)
    mean = private_mean(z, sigma_m, feature_norm, stream)
    mean = mean * min(1.0, feature_norm / max(float(mean.norm()), 1e-30))  # mu_hat in B(C_F): post-processing
    ledger.record(
        dpa.GaussianDpEvent(sigma_m),
        {
            "mechanism": "private_mean",
            "noise_multiplier": sigma_m,
            "sensitivity": feature_norm,
            "dataset_size": n,
            "delta": delta3,
        },
    )
    tail = default_quantile_tail(epsilon, n) if quantile_tail is None else int(quantile_tail)
    if not 0 <= tail < n:
        raise ConfigError(
            f"preprocessing.quantile_tail must be in [0, n) = [0, {n}), got {tail} (the default (100/eps) ln n "
            "is a proof constant that needs large n: set quantile_tail for small data)"
        )
    upper = 2.0 * feature_norm  # ||x - mu_hat|| <= ||x|| + ||mu_hat|| <= 2 C_F
    step = upper / n**2  # alpha = R / n^2 (App. B.2)
    distances = (z - mean).norm(dim=1).numpy()
    tau = exponential_quantile(distances, n - tail, eps3, upper, step, stream, tie_break=upper / n) + step
    ledger.record(
        dpa.UnsupportedDpEvent(),  # pure eps-DP: certified by the composition accountant, refused by rdp/pld
        {
            "mechanism": "private_quantile",
            "epsilon": eps3,
            "grid_step": step,
            "rank": n - tail,
            "dataset_size": n,
        },
    )
    return FeaturePreprocessing(kind, feature_norm, mean, float(tau), sigma_m, None)


def theory_clip_norm(tau: float, lipschitz: float = SOFTMAX_LIPSCHITZ) -> float:
    """sqrt(2) G tau (Alg. 2 step 5): with features clipped to sqrt(2) tau no gradient of a loss that is
    G-Lipschitz in the scores (``lipschitz``) is ever clipped."""
    return math.sqrt(2.0) * lipschitz * tau


def augmented_linear(model: nn.Module) -> nn.Linear:
    """Alg. 2 trains theta in R^{d+1} without a bias on (x - mu_hat, tau): a bias-free Linear(d+1, K) that starts
    from the given linear model (bias b as the last column b / tau is set once tau is known: here b starts at 0)."""
    layer = linear_layer(model, "dpsgd_f_theory")
    aug = nn.Linear(layer.in_features + 1, layer.out_features, bias=False)
    with torch.no_grad():
        aug.weight.zero_()
        aug.weight[:, :-1].copy_(layer.weight)
    return aug


# --- pipelines: preprocessing + DP-SGD --------------------------------------------------------------------


@dataclass
class Prepared:
    """What training needs after the preprocessing stage: the fitted transform, the ledger holding its releases,
    the model to train (bias-free and one input wider for Alg. 2) and the DP-SGD settings the kind imposes."""

    preprocessing: FeaturePreprocessing
    ledger: Ledger
    model: nn.Module
    settings: dict


def prepare(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kind: str,
    feature_norm: float | None,
    delta: float,
    eps_f: float | None = None,
    epsilon: float | None = None,
    quantile_tail: int | None = None,
    randomness: Randomness,
    fitted: FeaturePreprocessing | None = None,
    lipschitz: float = SOFTMAX_LIPSCHITZ,
) -> Prepared:
    """Fit the preprocessing (or reuse ``fitted``, e.g. on resume: nothing is released twice) and return what
    the DP-SGD phase runs on. Checks first, before anything is released. The private releases draw from
    ``randomness``'s secret "preprocessing" stream."""
    if kind in ("private_mean", "dpsgd_f_theory"):
        linear_layer(model, kind)
    if kind == "private_mean" and eps_f is not None and epsilon is not None and not eps_f < epsilon:
        raise ConfigError(
            f"preprocessing.eps_f must be smaller than the total privacy.target_epsilon = {epsilon:g}, got {eps_f:g}"
        )
    if kind == "dpsgd_f_theory" and eps_f is not None:
        raise ConfigError(
            "preprocessing.eps_f is for kind 'private_mean'; 'dpsgd_f_theory' splits the budget in thirds"
        )
    ledger = Ledger()
    prep = fitted or fit_preprocessing(
        x,
        kind,
        feature_norm,
        ledger,
        delta=delta,
        eps_f=eps_f,
        epsilon=epsilon,
        quantile_tail=quantile_tail,
        stream=randomness.stream("preprocessing"),
    )
    settings: dict = {}
    if prep.kind == "dpsgd_f_theory":
        model = augmented_linear(model)
        settings = {"max_grad_norm": theory_clip_norm(prep.tau, lipschitz), "accountant": "composition"}
    return Prepared(prep, ledger, model, settings)


@dataclass
class DPSGDFRun:
    """A DPSGD-F run: the private trainer (on preprocessed features) and the released preprocessing."""

    trainer: object  # dptrain.engine.trainer.PrivateTrainer
    preprocessing: FeaturePreprocessing

    def raw_model(self) -> RawFeatureLinear:
        """The trained model for raw examples (bias mapped back)."""
        return self.preprocessing.raw_model(self.trainer.model)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accuracy of :meth:`raw_model` on raw held-out examples (a classifier with one score per class)."""
        model = self.raw_model()
        if model.linear.out_features < 2:
            raise ModelError(
                "evaluate() needs one output per class; score a one-output model with raw_model()"
            )
        return float((model(x).argmax(1) == y).float().mean())


def make_private_dpsgd_f(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    target_epsilon: float,
    target_delta: float,
    feature_norm: float,
    kind: str = "private_mean",
    eps_f: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: float | None = None,
    max_grad_norm: float = 1.0,
    accountant: str = "pld",
    quantile_tail: int | None = None,
    lipschitz: float = SOFTMAX_LIPSCHITZ,
    seed: int | None = None,
    secure_noise: bool = False,
    noise_multiplier: float | None = None,
    **options,
) -> DPSGDFRun:
    """DPSGD-F in one call: preprocess ``data`` privately (``kind``), then DP-SGD on the linear ``model`` with the
    noise calibrated so that the whole pipeline is (target_epsilon, target_delta)-DP by ``accountant`` (PLD by
    default, as the paper; Alg. 2 is always certified by basic composition). The optimizer's class and settings
    are kept; for Alg. 2 it is rebuilt for the bias-free augmented model. ``optimizer`` may also be a factory
    ``(parameters, clip_norm) -> Optimizer``, called with the clip norm in effect (Alg. 2's sqrt(2) G tau is known
    only once tau is released), e.g. for a learning rate scaled by 1/C^2. ``kind="none"`` is plain DP-SGD on
    C_F-normalized features (the paper's DPSGD baseline). ``lipschitz`` is G of the loss in the scores (Alg. 2's
    clip norm sqrt(2) G tau; default: softmax cross-entropy's sqrt(2); 1 for the hinge loss). Options go to :func:`dptrain.engine.api.make_private`."""
    if options.get("augment"):  # (refused before any private statistic, as the config refuses it)
        raise ConfigError(
            "augment views images, and DPSGD-F's preprocessing turns them into flat feature vectors before "
            "training: use one or the other"
        )
    x, y = as_tensors(data)
    randomness = Randomness(seed, secure=secure_noise)
    prep = prepare(
        model,
        x,
        kind=kind,
        feature_norm=feature_norm,
        delta=target_delta,
        eps_f=eps_f,
        epsilon=target_epsilon,
        quantile_tail=quantile_tail,
        randomness=randomness,
        lipschitz=lipschitz,
    )
    settings = {"max_grad_norm": max_grad_norm, "accountant": accountant, **prep.settings}
    if not isinstance(optimizer, torch.optim.Optimizer):  # a factory: (parameters, clip norm in effect) -> optimizer
        optimizer = optimizer(prep.model.parameters(), settings["max_grad_norm"])
    elif prep.model is not model:
        optimizer = type(optimizer)(prep.model.parameters(), **optimizer.defaults)
    common = dict(batch_size=batch_size, ledger=prep.ledger, randomness=randomness, **settings, **options)
    data = (prep.preprocessing.transform(x), y)
    if noise_multiplier is not None:
        trainer = make_private(
            prep.model, optimizer, data, noise_multiplier=noise_multiplier, delta=target_delta, **common
        )
    else:
        trainer = make_private_with_epsilon(
            prep.model,
            optimizer,
            data,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            steps=steps,
            **common,
        )
    return DPSGDFRun(trainer, prep.preprocessing)


def pipeline_noise(
    kind: str,
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    eps_f: float | None = None,
    accountant: str = "pld",
) -> float:
    """The DP-SGD noise multiplier with which ``kind``'s preprocessing (``none`` or ``private_mean``) followed by
    ``steps`` Poisson-sampled steps is (target_epsilon, delta)-DP by ``accountant``: the calibration
    :func:`make_private_dpsgd_f` runs, without data (the releases' distributions do not depend on it)."""
    import dp_accounting as dpa

    prefix = Ledger()
    if kind == "private_mean":
        if eps_f is None or not 0 < eps_f < target_epsilon:
            raise ConfigError(
                f"eps_f must be in (0, {target_epsilon:g}) for kind 'private_mean', got {eps_f}"
            )
        prefix.record(
            dpa.GaussianDpEvent(gaussian_mechanism_noise(eps_f, delta)), {"mechanism": "private_mean"}
        )
    elif kind != "none":
        raise ConfigError(f"pipeline_noise covers kinds none and private_mean, not {kind!r}")

    def ledger_for(sigma: float) -> Ledger:
        event = gaussian_step_event(sigma, "poisson", sampling_rate=sampling_rate)
        return prefix.extended(event, step_facts("poisson", sampling_rate), steps)

    return calibrate_noise(target_epsilon, delta, ledger_for, accountant)


# --- the stage of a DP-SGD job (config section [preprocessing]) ------------------------------------------------

#: The released preprocessing (the noisy mean, tau): a shareable file of the run, read back on resume.
RELEASED_FILE = "preprocessing.json"


def stage(draft) -> None:
    """``[preprocessing]`` in a DP-SGD job (:class:`dptrain.runs.job.Draft`): fit the preprocessing on the training set,
    recording its releases in the ledger the trainer starts from, or reuse the one a resumed run released; the
    trainer then sees the transformed data and model, and the returned model is mapped back to raw examples."""
    cfg, pre = draft.cfg, draft.cfg.preprocessing
    if not pre.active:
        return
    fitted = None
    if RELEASED_FILE in draft.resumed:
        try:
            fitted = FeaturePreprocessing.from_dict(draft.resumed[RELEASED_FILE])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DataError(
                f"{RELEASED_FILE} is missing or corrupt: the run's released preprocessing is needed to resume it"
            ) from None
    prepared = prepare(
        draft.model,
        draft.data.train.x,
        kind=pre.kind,
        feature_norm=pre.feature_norm,
        delta=cfg.privacy.delta,
        eps_f=pre.eps_f,
        epsilon=cfg.privacy.target_epsilon,
        quantile_tail=pre.quantile_tail,
        randomness=draft.randomness,
        fitted=fitted,
    )
    prep, raw_test = prepared.preprocessing, draft.data.test

    def part(ds: ArrayDataset) -> ArrayDataset:
        return ArrayDataset(prep.transform(ds.x), ds.y, ds.num_classes, ds.name)

    what = (
        f"{pre.kind} preprocessing" if pre.kind != "none" else f"features normalized to {pre.feature_norm:g}"
    )
    draft.data = DataSplit(part(draft.data.train), part(raw_test), f"{draft.data.description}, {what}", draft.data.separate_test)
    draft.model = prepared.model
    draft.options.update(prepared.settings)
    if fitted is None:
        draft.options["ledger"] = prepared.ledger
    draft.released[RELEASED_FILE] = prep.to_dict()
    draft.transform = prep.transform
    draft.save_model = lambda rd, trainer: _save_raw_model(rd, trainer, prep, raw_test)


def _save_raw_model(rd, trainer, prep: FeaturePreprocessing, raw_test) -> dict:
    """The returned model of a preprocessing run: the trained linear map with the bias mapped back, so it applies
    to raw examples (normalized inside). Written as ``model.pt``; its test accuracy on the raw test set is reported
    beside the trainer's (they agree: docs/dpsgd_f.md)."""
    model = prep.raw_model(trainer.model)
    rd.save_model({"state_dict": model.state_dict(), "preprocessing": prep.to_dict()})
    with torch.no_grad():
        acc = float((model(raw_test.x).argmax(1) == raw_test.y).float().mean())
    return {
        "preprocessing": {k: v for k, v in prep.to_dict().items() if k != "mean"},
        "test_accuracy_raw_model": acc,
    }
