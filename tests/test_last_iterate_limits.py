"""The last-iterate accountant (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent") at the limits of
its arithmetic: a one-line refusal, never a traceback or a number computed from an underflow."""

import pytest

from dptrain.errors import AccountingError


@pytest.mark.parametrize("batching", ["random", "cyclic", "full"])
@pytest.mark.parametrize("extreme", [dict(noise_std=1e-300), dict(learning_rate=1e-300), dict(noise_std=1e200)])
def test_the_last_iterate_bound_refuses_numbers_its_arithmetic_cannot_hold_in_one_line(batching, extreme):
    """A noise or step size so small that sigma^2 or eta^2 sigma^2 underflows divided by zero (a traceback); a noise
    so large that the Gaussian's arithmetic overflows. Each is refused in one line, as every accountant does."""
    from dptrain.accounting.last_iterate import Setting, last_iterate_report

    common = dict(n=100, b=100 if batching == "full" else 10, noise_std=0.5, lipschitz=1.0, diameter=10.0,
                  learning_rate=1.0, steps=100, smoothness=1.0, batching=batching)
    with pytest.raises(AccountingError) as err:
        last_iterate_report(Setting(**{**common, **extreme}), 1e-5)
    assert "\n" not in str(err.value)
