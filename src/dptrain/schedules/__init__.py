"""Dynamic noise schedules ("On Dynamic Noise Influence in Differential Private Learning", anonymous ICLR 2021
submission): how a fixed privacy budget is spread over the steps of a run.

- :mod:`dptrain.schedules.bounds`: the paper's formulas (budget conversions, influences, T-hat, Lemma 4.1's
  allocation), utility bounds and optimal step counts (numpy only);
- :mod:`dptrain.schedules.kinds`: schedule shapes (sigma_t for t = 1..T), built from those formulas, and their
  calibration to a budget by one common scale factor (numpy/scipy/dp_accounting only).
"""
