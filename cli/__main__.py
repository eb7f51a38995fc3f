"""`python -m cli` is `mamba-stream`."""

import sys

from cli import main

sys.exit(main())
