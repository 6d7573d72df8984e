"""Projected noisy SGD for convex generalized linear models, releasing only the last iterate (Altschuler & Talwar,
"Privacy of Noisy Stochastic Gradient Descent: More Iterations without More Privacy Loss").

- :mod:`dptrain.last_iterate.glm`: the losses (:class:`ConvexGLM`), with closed-form L, M and m;
- :mod:`dptrain.last_iterate.stages`: the engine stages (projection, closed-form gradients, the Lipschitz bound
  instead of clipping, the projected update);
- :mod:`dptrain.last_iterate.algorithm`: the algorithm (:class:`ProjectedNoisySGD`) run by the DP-SGD engine with
  those stages;
- :mod:`dptrain.last_iterate.job`: the job of ``training.algorithm = "projected_noisy_sgd"``;
- :mod:`dptrain.last_iterate.config`: the ``[convex]`` config section, its validator and the job it builds;
- the accountant is :mod:`dptrain.accounting.last_iterate` (no torch).

Names are read from :mod:`dptrain.last_iterate.algorithm` on first use, so importing the config section does not
import torch.
"""

from dptrain._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, "algorithm")
