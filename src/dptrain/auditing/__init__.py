"""Empirical privacy auditing: lower bounds on epsilon from canaries inserted into one training run.

Paper: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023, arXiv 2305.08846).
:mod:`dptrain.auditing.bounds` holds the statistics (numpy/scipy only, never torch): from the auditor's guesses
it computes an epsilon lower bound that holds with a stated confidence.
:mod:`dptrain.auditing.canaries` draws and inserts the canaries (:mod:`dptrain.auditing.auxiliary`: DP-SGD's
gradient canaries on auxiliary coordinates, scored on every released update), :mod:`dptrain.auditing.bugs`
breaks an engine on purpose (``--inject-bug``), :mod:`dptrain.auditing.runner` audits a configuration in one run
(``dptrain audit``).
"""

#: Canary kinds (:mod:`dptrain.auditing.canaries`): white-box Dirac gradients, or black-box examples.
KINDS = ("gradient", "input")

#: The bugs ``dptrain audit --inject-bug`` accepts (:mod:`dptrain.auditing.bugs`): the noise divided by 2, 10 or
#: 100, or clipping switched off. Here, not in ``bugs``, so that building the CLI's parser imports no torch.
BUGS = ("noise/2", "noise/10", "noise/100", "clipping-off")
