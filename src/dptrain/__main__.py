"""``python -m dptrain ...`` is the ``dptrain`` command (also under torchrun)."""

from dptrain.cli import entry

entry()
