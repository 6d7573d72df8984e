"""The stages of a private step: batch selection, per-example gradients (and the forms they are kept in), clipping,
noise, numeric precision and devices. The engine (:mod:`dptrain.engine.trainer`) composes them."""
