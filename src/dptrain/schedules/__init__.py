"""Dynamic noise schedules ("On Dynamic Noise Influence in Differential Private Learning", anonymous ICLR 2021
submission): how a fixed privacy budget is spread over the steps of a run.

- :mod:`dptrain.schedules.bounds`: the paper's formulas (budget conversions, influences, T-hat, Lemma 4.1's
  allocation), utility bounds and optimal step counts (numpy only); the public names of
  :mod:`~dptrain.schedules.bounds_constants` (constants, budget conversions), :mod:`~dptrain.schedules.bounds_gd`
  (gradient descent) and :mod:`~dptrain.schedules.bounds_momentum` (momentum);
- :mod:`dptrain.schedules.kinds`: schedule shapes (sigma_t for t = 1..T), built from those formulas, and their
  calibration to a budget by one common scale factor (numpy/scipy/dp_accounting only); the public names of
  :mod:`~dptrain.schedules.shapes` (the shapes), :mod:`~dptrain.schedules.budget` (the budgets),
  :mod:`~dptrain.schedules.spend` (what a schedule spends under each accountant) and
  :mod:`~dptrain.schedules.calibration` (the scale that spends exactly the budget).
"""
