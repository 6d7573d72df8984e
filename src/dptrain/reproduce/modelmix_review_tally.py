"""Comparisons lhs <= rhs with tolerances and error estimates, and their tally per check, for the numerical soundness
review (:mod:`dptrain.reproduce.modelmix_review`) of Xiao, Wan & Devadas, "Differentially Private Deep Learning with
ModelMix".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

REL_TOL = 1e-9
ABS_TOL = 1e-12
MAX_LISTED = 5  # violations / within-error points listed per check


def compare(lhs: np.ndarray, rhs: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Status of the claims lhs <= rhs, elementwise: 0 holds (lhs - rhs <= 1e-9 max(|lhs|, |rhs|) + 1e-12),
    1 within numerical error (exceeds the tolerance by no more than the error estimate ``err``), 2 violated."""
    lhs, rhs, err = (np.asarray(x, dtype=float) for x in (lhs, rhs, err))
    margin = lhs - rhs
    tol = REL_TOL * np.maximum(np.abs(lhs), np.abs(rhs)) + ABS_TOL
    status = np.where(margin <= tol, 0, np.where(margin - err <= tol, 1, 2))
    return np.where(np.isfinite(margin) & np.isfinite(err), status, 2)


def convexity_margins(x: np.ndarray, g: np.ndarray, err: np.ndarray):
    """For convexity of g on the uniform grid x: the comparisons 2 g_i <= g_{i-1} + g_{i+1} as (x_i, lhs, rhs,
    err) for the interior points."""
    g = np.asarray(g, dtype=float)
    err = np.asarray(err, dtype=float)
    return x[1:-1], 2 * g[1:-1], g[:-2] + g[2:], 2 * err[1:-1] + err[:-2] + err[2:]


def clean(v: Any) -> Any:
    """Plain JSON-able values (floats, ints, strings, bools, lists, dicts)."""
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if isinstance(v, np.ndarray):
        return [clean(x) for x in v.tolist()]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else repr(f)
    return v


class Tally:
    """Accumulates the comparisons of one check."""

    def __init__(self, name: str, claim: str, parameters: dict, note: str = ""):
        self.name, self.claim, self.parameters, self.note = name, claim, parameters, note
        self.checked = 0
        self.counts = [0, 0, 0]
        self.worst: dict[str, dict] = {}
        self.listed: dict[int, list[dict]] = {1: [], 2: []}
        self.failing: dict[str, dict] = {}
        self.max_err_rel = 0.0
        self.vacuous = 0

    def add(self, where: dict, xname: str, xs, lhs, rhs, err) -> None:
        xs, lhs, rhs, err = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (xs, lhs, rhs, err))
        status = compare(lhs, rhs, err)
        margin = lhs - rhs
        scale = np.maximum(np.maximum(np.abs(lhs), np.abs(rhs)), ABS_TOL)
        rel = margin / scale
        self.checked += len(xs)
        for k in range(3):
            self.counts[k] += int(np.sum(status == k))
        informative = scale >= 1e3 * ABS_TOL
        self.vacuous += int(np.sum(np.maximum(np.abs(lhs), np.abs(rhs)) < ABS_TOL))
        if informative.any():
            self.max_err_rel = max(self.max_err_rel, float(np.max(err[informative] / scale[informative])))

        def point(i: int) -> dict:
            return {**where, xname: xs[i], "lhs": lhs[i], "rhs": rhs[i], "margin": margin[i],
                    "relative_margin": rel[i], "error_estimate": err[i]}

        # the worst point: largest relative margin among the informative points (a value >= 1e-12), if any
        pool = np.where(np.isfinite(rel), rel, np.inf)  # a non-finite margin is the worst
        if np.any(scale > ABS_TOL):
            pool = np.where(scale > ABS_TOL, pool, -np.inf)
        i = int(np.argmax(pool))
        for key in ("all", "gaussian_control" if where.get("w") == 0 else "w_positive"):
            if key not in self.worst or rel[i] > self.worst[key]["relative_margin"]:
                self.worst[key] = point(i)
        for k in (1, 2):
            idx = np.flatnonzero(status == k)
            if len(idx):
                top = idx[np.argsort(-rel[idx])][:MAX_LISTED]
                self.listed[k] = sorted(self.listed[k] + [point(j) for j in top],
                                        key=lambda p: -p["relative_margin"])[:MAX_LISTED]
        bad = status == 2
        if bad.any():
            key = repr(sorted(where.items()))
            entry = self.failing.setdefault(key, {**where, "violations": 0, "max_relative_margin": -np.inf})
            entry["violations"] += int(bad.sum())
            entry["max_relative_margin"] = max(entry["max_relative_margin"], float(np.max(rel[bad])))

    def result(self) -> dict:
        status = "fails" if self.counts[2] else ("within numerical error" if self.counts[1] else "holds")
        w = self.worst.get("all", {})
        return clean({
            "name": self.name,
            "claim": self.claim,
            "parameters": self.parameters,
            "checked": self.checked,
            "worst_margin": w.get("margin", 0.0),
            "worst_relative_margin": w.get("relative_margin", 0.0),
            "worst_at": w,
            "worst_at_w_positive": self.worst.get("w_positive"),
            "worst_at_gaussian_control": self.worst.get("gaussian_control"),
            "holds": status == "holds",
            "status": status,
            "violation_count": self.counts[2],
            "violations": self.listed[2],
            "within_numerical_error_count": self.counts[1],
            "within_numerical_error": self.listed[1],
            "failing_parameters": sorted(self.failing.values(), key=lambda e: -e["max_relative_margin"]),
            "max_relative_error_estimate": self.max_err_rel,
            "vacuous_count": self.vacuous,
            "note": self.note,
        })
