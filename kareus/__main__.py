"""``python -m kareus`` runs the command line."""

from __future__ import annotations

import sys

from kareus.cli import main

sys.exit(main())
