"""The fixed setup of the reproduction of Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More
Iterations without More Privacy Loss" (:mod:`dptrain.reproduce.last_iterate`): the order and delta of the report,
Example A of docs/last_iterate.md and its reference values (section (a)), the Fashion-MNIST task and the
certifications compared (section (b)), and how much of it runs (:class:`Scale`: :data:`FULL`, :data:`QUICK`).

The experiments (:mod:`dptrain.reproduce.last_iterate`) and the text of the report
(:mod:`dptrain.reproduce.last_iterate_text`) both read it; it imports neither.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ALPHA, DELTA = 8.0, 1e-5

#: Example A of docs/last_iterate.md: alpha = 8 (ALPHA), q = b/n = 0.01, b sigma/(2L) = 20, Dn/(L eta) = 10^4.
REFERENCE = {
    "n": 1000,
    "b": 10,
    "noise_std": 4.0,
    "lipschitz": 1.0,
    "diameter": 1.0,
    "learning_rate": 0.1,
    "smoothness": 1.0,
    "adjacency": "replace",
}
#: Reference values of Example A at order 8, checked to 4 significant digits: (B.2) with S_alpha of Def 2.10 by
#: quadrature at T = 1000 (the composition branch, 1000 S_8(0.01, 20)) and on the plateau, and (B.3) on the
#: plateau with m = 0.1, M = 1, eta = 0.1 (c = 0.99).
REF_RDP_T1000, REF_RDP_PLATEAU, REF_SC_PLATEAU = 1.00103e-3, 2.00205e-2, 6.84902e-4
STRONG_CONVEXITY = (
    0.1  # m = 0.1 with M = 1 and eta = 0.1: c = max(|1 - eta m|, |1 - eta M|) = 0.99 (Lemma 5.5)
)
TABLE_T = (10, 100, 1000, 10_000, 20_000, 100_000, 1_000_000)
SETTING_LABELS = {
    "reference": "Example A (b = 10, random batches, (B.2))",
    "full_batch": "full batch (b = n = 1000, (B.1)/(B.2))",
    "strongly_convex": "strongly convex (m = 0.1, M = 1, (B.3))",
}

#: Section (b): Fashion-MNIST classes. T-shirt/top vs Pullover: a linear model on norm-1 features reaches ~95%
#: without noise (decent, not perfect); see last_iterate_text.section_b for the pilot numbers behind the choice.
CLASS_NAMES = {0: "T-shirt/top", 2: "Pullover"}
NEGATIVE_CLASS, POSITIVE_CLASS = 0, 2
TRAINING = {
    "loss": "logistic",
    "feature_norm": 1.0,
    "l2": 1e-2,
    "batch_size": 256,
    "diameter": 10.0,
    "epsilon": 1.0,
    "delta": DELTA,
}


def t_grid(quick: bool) -> list[int]:
    """About 30 log-spaced T in [10, 10^6] plus the table's T values; quick: 8 values up to 10^5 (keeping the
    T = 1000 and T = 20000 reference points)."""
    if quick:
        return [10, 100, 1000, 5000, 10_000, 20_000, 50_000, 100_000]
    grid = {int(round(t)) for t in np.geomspace(10, 1e6, 30)}
    return sorted(grid | set(TABLE_T))


@dataclasses.dataclass(frozen=True)
class Scale:
    """How much of the reproduction runs: section (a)'s values of T; section (b)'s training examples per class
    (None: all), seeds, epochs (for every certification), calibration tolerance, epochs of the non-private
    reference and the diameters of the sweep at 100 epochs (empty: none); section (c)'s noise levels."""

    quick: bool
    grid: tuple[int, ...]
    per_class: int | None
    seeds: tuple[int, ...]
    epochs: tuple[int, ...]
    rtol: float
    nonprivate_epochs: int
    diameter_sweep: tuple[float, ...]
    soundness_sigmas: tuple[float, ...] = (1e-3, 3e-3, 1e-2)


FULL = Scale(
    quick=False,
    grid=tuple(t_grid(False)),
    per_class=None,
    seeds=(0, 1, 2),
    epochs=(1, 5, 20, 100),
    rtol=1e-6,
    nonprivate_epochs=20,
    diameter_sweep=(2.0, 10.0, 50.0),
)
#: quick: 8 values of T up to 10^5; 2000 training examples, one seed, 1 and 5 epochs, no diameter sweep
#: (rtol 1e-3: fewer accountant evaluations, each "rdp" one takes ~0.3 s).
QUICK = Scale(
    quick=True,
    grid=tuple(t_grid(True)),
    per_class=1000,
    seeds=(0,),
    epochs=(1, 5),
    rtol=1e-3,
    nonprivate_epochs=5,
    diameter_sweep=(),
)



CERTIFICATIONS = {
    "composition": "composition (dp_accounting RDP, sampled w/o replacement): certified",
    "last_iterate": "the paper's last-iterate bound as published (Def 2.10 direction; fails section (c))",
    "conservative": "dptrain's last-iterate bound (dominating direction; the `last_iterate` accountant, NOT certified)",
}


__all__ = [
    "ALPHA",
    "CERTIFICATIONS",
    "CLASS_NAMES",
    "DELTA",
    "FULL",
    "NEGATIVE_CLASS",
    "POSITIVE_CLASS",
    "QUICK",
    "REFERENCE",
    "REF_RDP_PLATEAU",
    "REF_RDP_T1000",
    "REF_SC_PLATEAU",
    "SETTING_LABELS",
    "STRONG_CONVEXITY",
    "TABLE_T",
    "TRAINING",
    "Scale",
    "t_grid",
]
