"""``float(report)`` of a PrivacyReport (``float(loop.epsilon())``) is its epsilon where that is a finite certified
bound, and a one-line AccountingError otherwise (an approximation, a run that is not private, no finite epsilon);
formatting a report with a spec formats that number; its other uses (repr, to_dict, comparing epsilons) are as
before."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.accounting import PrivacyReport, dpsgd_ledger, epsilon
from dptrain.engine.private_loop import make_private_loop
from dptrain.errors import AccountingError


def test_float_of_a_certified_report_is_its_epsilon():
    report = epsilon(dpsgd_ledger(1.0, 0.01, 100), 1e-5, "rdp")
    assert report.certified and float(report) == report.epsilon and math.isfinite(float(report))
    assert f"{report:.3f}" == f"{report.epsilon:.3f}" and f"{report}" == repr(report) == str(report)
    assert float(report) < float(epsilon(dpsgd_ledger(1.0, 0.01, 200), 1e-5, "rdp"))
    assert report.to_dict()["epsilon"] == report.epsilon


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (PrivacyReport(1.5, 1e-5, "gdp", False, {"note": "a CLT limit"}), r"not certified \(a CLT limit\)"),
        (PrivacyReport(2.0, 1e-5, "rdp", False, {"note": "NOT private: seeded randomness"}), "NOT private"),
        (PrivacyReport(math.inf, 1e-5, "rdp", True), "no finite epsilon"),
        (PrivacyReport(math.nan, 1e-5, "rdp", True), "no finite epsilon"),
    ],
)
def test_float_refuses_what_is_not_a_finite_certified_epsilon(report, message):
    for convert in (float, lambda r: f"{r:.2f}"):
        with pytest.raises(AccountingError, match=message) as refused:
            convert(report)
        assert "\n" not in str(refused.value)
    assert f"{report}" == repr(report)  # (printing a report never refuses)


def _loop(**options):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (x, y), noise_multiplier=1.0, batch_size=16, accountant="rdp", **options)
    for xb, yb in loop.batches(steps=2):
        loop.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        opt.step()
    return loop


def test_float_of_a_loops_epsilon():
    loop = _loop()
    assert float(loop.epsilon()) == epsilon(dpsgd_ledger(1.0, 0.25, 2), 1e-5, "rdp").epsilon
    seeded = _loop(seed=0)  # (reproducible, NOT private: its report is not certified)
    with pytest.raises(AccountingError, match="NOT private: seeded randomness"):
        float(seeded.epsilon())
    assert seeded.epsilon().epsilon == loop.epsilon().epsilon
