"""DPSGD-F: private feature preprocessing before DP-SGD on a linear model (Sun, Suresh & Menon, "The importance of
feature preprocessing for differentially private linear optimization", ICLR 2024).

- :mod:`dptrain.dpsgd_f.algorithm`: the preprocessing stage (private mean, private quantile, feature maps) and
  ``make_private_dpsgd_f``;
- :mod:`dptrain.dpsgd_f.config`: the ``[preprocessing]`` config section and its validator.

Names are read from :mod:`dptrain.dpsgd_f.algorithm` on first use, so importing the config section does not
import torch.
"""

from dptrain._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, "algorithm")
