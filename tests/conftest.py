"""Test-session settings. Under pytest-xdist (``make test`` runs two workers on the two cores) each worker keeps
torch to one intra-op thread, so that two workers do not oversubscribe the cores."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
