"""Empirical privacy auditing: lower bounds on epsilon from canaries inserted into one training run.

Paper: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023, arXiv 2305.08846).
:mod:`dptrain.auditing.bounds` holds the statistics (numpy/scipy only, never torch): from the auditor's guesses
it computes an epsilon lower bound that holds with a stated confidence.
:mod:`dptrain.auditing.canaries` draws and inserts the canaries, :mod:`dptrain.auditing.runner` audits a
configuration in one run (``dptrain audit``).
"""

#: Canary kinds (:mod:`dptrain.auditing.canaries`): white-box Dirac gradients, or black-box examples.
KINDS = ("gradient", "input")
