"""Proactive DP (van Dijk et al., "Proactive DP: A Multiple Target Optimization Framework for DP-SGD"): the
planner behind ``dptrain plan`` and the utility graph. Its accountant is :mod:`dptrain.accounting.proactive`."""
