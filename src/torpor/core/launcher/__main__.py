"""``python -m torpor.core.launcher SPEC READY_FD GO_FD LIFE_FD``: a launcher in a new interpreter."""

import sys

from torpor.core.launcher.server import main

sys.exit(main())
