"""``python -m captum_attention``: the command line."""

import sys

from captum_attention.presentation.cli import main

sys.exit(main())
