"""ModelMix (Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix"): DP-SGD whose update mixes
the last two iterates coordinate-wise with secret uniform weights, keeping a minimum gap tau between them.

- :mod:`dptrain.modelmix.update`: the update rule :class:`ModelMixSGD` (Algorithm 1), an engine stage that takes
  the optimizer's place;
- :mod:`dptrain.modelmix.config`: the ``[modelmix]`` config section (``training.update = "modelmix"``);
- :mod:`dptrain.accounting.modelmix`: its accountant; :class:`dptrain.stages.clipping.L2LinfClipping`: Algorithm 2.

Names are read from :mod:`dptrain.modelmix.update` on first use, so importing the config section does not import
torch.
"""

from dptrain._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, "update")
