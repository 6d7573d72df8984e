"""Passes of a model that leave no trace: evaluation mode, torch's generators forked, and after them every module's
training flag and every buffer the passes wrote as they were. The layout measurement (:mod:`dptrain.stages.batch_layout`)
and the check of an encoder-decoder's decoder inputs (:mod:`dptrain.models.decoder_inputs`) run the model this way."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def quiet_passes(model: nn.Module, *, grad: bool):
    """Evaluation mode (no dropout, so that two passes can be compared), autograd on or off (``grad``), torch's
    generators forked on every device the model uses; after, every module's training flag as it was and every buffer
    the passes wrote put back (only those: restoring one they left alone would count as a write for the state watch,
    :class:`dptrain.preflight.buffers.BufferWatch`, which reads version counters)."""
    modes = [(m, m.training) for m in model.modules()]
    saved = {n: (b.detach().clone(), b._version) for n, b in model.named_buffers()}
    devices = sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)
    try:
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
            model.eval()
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved and b.shape == saved[n][0].shape and b._version != saved[n][1]:
                    b.copy_(saved[n][0])


__all__ = ["quiet_passes"]
