"""Private hyperparameter tuning: a random search whose number of trials is secret, certified as one release (Papernot
& Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022). docs/tuning.md.

- :mod:`dptrain.tuning.config`: the ``[tune]`` section (imports no torch);
- :mod:`dptrain.tuning.space`: the search space, validated and sampled;
- :mod:`dptrain.tuning.search`: the search itself (``dptrain tune``);
- :mod:`dptrain.tuning.state`: its secret state, and what a resume holds it to (the draws again from their origin,
  the noise again from the frozen config, the trials' directories marked as the search's);
- :mod:`dptrain.tuning.release`: what it releases (the search's certificate, ``best/``) and nothing that depends on
  the number of trials;
- :mod:`dptrain.tuning.quiet`: what it shows while it runs (a clock, never a count of trials).
"""
