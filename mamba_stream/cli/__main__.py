"""`python -m cli` is `mamba-stream`."""

import sys

from mamba_stream.cli import main

sys.exit(main())
