"""``python -m te_lab.cli`` is ``te-lab``."""

import sys

from te_lab.cli import main

sys.exit(main())
