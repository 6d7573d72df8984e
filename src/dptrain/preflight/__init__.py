"""Checks on the user's model and data before the first step: labels, buffers a training-mode forward writes,
examples that influence each other, per-example gradients against single-example passes."""
