"""``python -m dptrain.cli ...``: the same as the ``dptrain`` command."""

import sys

from dptrain.cli import main

sys.exit(main())
