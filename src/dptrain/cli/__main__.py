"""``python -m dptrain.cli ...``: the same as the ``dptrain`` command."""

from dptrain.cli import entry

entry()
