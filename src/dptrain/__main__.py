"""``python -m dptrain ...`` is the ``dptrain`` command (also under torchrun)."""

import sys

from dptrain.cli import main

sys.exit(main())
