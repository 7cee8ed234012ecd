"""`python -m quantmla_hf.cli ...`: the `quantmla` command."""

import sys

from .main import main

sys.exit(main())
