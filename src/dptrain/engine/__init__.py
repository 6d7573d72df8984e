"""The private step and what runs it: the trainer (:mod:`dptrain.engine.trainer.trainer`), your own loop
(:mod:`dptrain.engine.trainer.private_loop`), checkpoints, atomic steps, evaluation, the privacy side and data parallelism."""
