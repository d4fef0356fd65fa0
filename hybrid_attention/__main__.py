"""`python -m hybrid_attention ...` is the `hybrid-attention` command."""

import sys

from hybrid_attention.cli import main

if __name__ == "__main__":
    sys.exit(main())
