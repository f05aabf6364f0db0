"""`python -m lightning_tp3d.cli ...` runs the `tp3d` command."""

import sys

from lightning_tp3d.cli import main

sys.exit(main())
