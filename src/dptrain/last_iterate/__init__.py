"""Projected noisy SGD for convex generalized linear models, releasing only the last iterate (Altschuler & Talwar,
"Privacy of Noisy Stochastic Gradient Descent: More Iterations without More Privacy Loss").

- :mod:`dptrain.last_iterate.algorithm`: the losses (:class:`ConvexGLM`) and the algorithm
  (:class:`ProjectedNoisySGD`) as stages of the DP-SGD engine;
- :mod:`dptrain.last_iterate.config`: the ``[convex]`` config section, its validator and the job it builds;
- the accountant is :mod:`dptrain.accounting.last_iterate` (no torch).

Names are read from :mod:`dptrain.last_iterate.algorithm` on first use, so importing the config section does not
import torch.
"""

from dptrain._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, "algorithm")
