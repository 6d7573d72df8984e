"""State a training pass writes is refused whatever object holds it (issue 29 item 2, fifth round).

Before: a module attribute's fingerprint read tensors, numbers, lists, tuples and dicts, and every other object by its
identity only. A running statistic kept in a ``deque``, a ``set``, a dataclass, a ``SimpleNamespace``, a NumPy array
(``self.hist += ...`` writes in place), or as a Python attribute set on a parameter or a buffer (``w.stat = ...``,
pickled with it) was accepted and the run certified. Now an attribute is read by what pickling it saves, container by
container and field by field, arrays by value and tensors with the attributes set on them."""

import warnings
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.errors import ModelError
from dptrain.preflight.buffers import BufferWatch

X = torch.randn(300, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


@dataclass
class Running:
    mean: object = None


def _keeps(kind: str):
    """A model keeping a statistic of each batch in an object of ``kind`` (returns the model and a reader of it)."""

    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)
            self.deque, self.set, self.array = deque(maxlen=4), set(), np.zeros(6)
            self.running, self.ns = Running(), SimpleNamespace(calls=0)

        def forward(self, x):
            stat = x.detach().mean(0)
            if kind == "deque":
                self.deque.append(stat)
            elif kind == "set":
                self.set.add(float(stat[0]))
            elif kind == "dataclass":
                self.running.mean = stat
            elif kind == "namespace":
                self.ns.calls += 1  # (a count of the chunks: the secret batch sizes)
            elif kind == "numpy":
                self.array += stat.numpy()
            elif kind == "parameter attribute":
                self.lin.weight.stat = stat
            return self.lin(x)

    return Keeps()


KINDS = {"deque": "attribute 'deque'", "set": "attribute 'set'", "dataclass": "attribute 'running'",
         "namespace": "attribute 'ns'", "numpy": "attribute 'array'", "parameter attribute": "parameter 'lin.weight'"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_statistic_kept_in_any_object_is_refused_and_the_probe_leaves_no_trace(kind):
    model = _keeps(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModelError, match=f"model {KINDS[kind]} is written by a training-mode forward pass") as e:
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), noise_multiplier=1.0,
                         batch_size=64)
    assert "\n" not in str(e.value)
    # put back where the watch kept a copy: the array's values, the parameter's attributes (at most what the all-zero
    # warm-up input set, preflight.warm_up: nothing of the examples)
    assert not model.array.any() and not getattr(model.lin.weight, "stat", torch.zeros(1)).any()


def test_equal_copies_and_torchs_own_flags_are_not_writes():
    """What must not count: an object rebuilt with the same content (a config whose pickled state is made anew at
    each read), nn.Module's machinery reached through an attribute (a hook's handle), torch.compile's flag on a
    parameter; what must: a field changed in place deep inside a nested object."""
    model = nn.Linear(6, 2)
    model.meta = {"nested": SimpleNamespace(inner=Running(mean=1.0), values=(1, 2.5, "a"))}
    model.handle = model.register_forward_hook(lambda *a: None)
    watch = BufferWatch(model)
    model.meta = {"nested": SimpleNamespace(inner=Running(mean=1.0), values=(1, 2.5, "a"))}  # an equal copy
    model.register_forward_pre_hook(lambda *a: None)  # (the hooks dict the handle reaches changes)
    model.weight._dynamo_static_input_type = "unguarded"
    assert watch.written() == []
    model.meta["nested"].inner.mean = 1.5
    assert watch.written() == ["meta"]
