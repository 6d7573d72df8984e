"""Reproduction of van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A Multiple Target Optimization
Framework for DP-SGD" (docs/proactive.md).

``run(out_dir, quick=False)`` writes ``proactive.md`` (the report), ``proactive.json`` (every number) and PNG
plots into ``out_dir``. Sections:

(a) Tables 9-11 (Sec. 4.4 / App. D.4): the simplified DP calculator and the tight f-DP (Gaussian DP)
    accountant the paper compares it with, paper value beside ours.
(b) Closed-form epsilon / tight PLD epsilon at T_min, for the paper's settings and three of our own.
(c) A logistic-regression experiment in the spirit of Table 3 / Fig. 1 (LIBSVM, strongly/plain convex):
    accuracy of Poisson-sampled DP-SGD against the batch size s at a fixed budget of gradient computations
    K = kN, the paper's claim being that the largest allowed s (fewest rounds T = T_min) is best.
(d) The utility graph of Sec. 3.3 on the same task (not in the paper's tables; what the pro-active flow
    would read off before training).

Formulas (each cited where it is used):
- eq. (6) / its inverse (App. D.4 step 1): sigma = sqrt(2 (eps + ln(1/delta))/eps), eps = 2 ln(1/delta)/(sigma^2-2);
- eq. (8): T_min = gamma theta^2 k^2 / eps, s_max = floor(kN/T_min) (App. D.4 steps 5-6);
- App. C.2 / D.4: T_min_asym = theta^2 k^2/(2 eps), s_max_asym = floor(kN/T_min_asym);
- eq. (65): mu = sqrt(2) sqrt(e^{1/sigma^2} Phi(1.5/sigma) + 3 Phi(-0.5/sigma) - 2) sqrt(T) s/N (CLT,
  uniform subsampling, Dong-Roth-Su Cor. 5.4) and eq. (64): delta(eps) = Phi(-eps/mu + mu/2) -
  e^eps Phi(-eps/mu - mu/2), solved for delta = 1/N;
- Sec. 4.1 / Tables 1-2: step size eta_t = eta0/(1 + beta sqrt(t)), t = number of samples processed.

The parts: :mod:`~dptrain.reproduce.proactive_setup` (the fixed setup), :mod:`~dptrain.reproduce.proactive_calculator`
(sections (a) and (b)), :mod:`~dptrain.reproduce.proactive_logistic` (sections (c) and (d)) and
:mod:`~dptrain.reproduce.proactive_text` (the report); this module runs them.
"""

from __future__ import annotations

import time
from pathlib import Path

from dptrain.reproduce import single_thread
from dptrain.reproduce.proactive_calculator import ratio_rows, tables_9_11
from dptrain.reproduce.proactive_logistic import logistic_experiment, utility_graph_data
from dptrain.reproduce.proactive_setup import EXPERIMENT as EXPERIMENT
from dptrain.reproduce.proactive_setup import FULL, OWN_SETTINGS, PAPER_TABLES, QUICK, Scale
from dptrain.reproduce.proactive_setup import NEGATIVE_CLASS as NEGATIVE_CLASS
from dptrain.reproduce.proactive_setup import POSITIVE_CLASS as POSITIVE_CLASS
from dptrain.reproduce.proactive_text import render

__all__ = [
    "FULL",
    "OWN_SETTINGS",
    "PAPER_TABLES",
    "QUICK",
    "Scale",
    "logistic_experiment",
    "ratio_rows",
    "render",
    "run",
    "tables_9_11",
    "utility_graph_data",
]


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``proactive.md``.
    ``quick`` keeps (a) and (b) complete and shrinks (c) to N = 2000, k = 2, one seed, s in {5, s_max} and
    (d) to one C and three sigmas."""
    scale = QUICK if quick else FULL
    command = f"dptrain reproduce proactive --out {Path(out_dir)}" + (" --quick" if quick else "")
    start = time.perf_counter()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    rows_a = tables_9_11()
    timings["a"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows_b = ratio_rows()
    timings["b"] = time.perf_counter() - t0

    with single_thread():  # a 1570-parameter model
        t0 = time.perf_counter()
        exp = logistic_experiment(scale)
        timings["c"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ug = utility_graph_data(scale)
        timings["d"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - start
    data = {
        "command": command,
        "quick": quick,
        "timings_s": timings,
        "tables_9_11": rows_a,
        "ratios": rows_b,
        "logistic": exp,
        "utility_graph": ug,
    }
    return render(data).write(out_dir)
