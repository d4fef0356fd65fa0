"""`python -m hybrid_attention.synth ...` is `hybrid-attention synth ...`."""

import sys

from hybrid_attention.cli import main

sys.exit(main(["synth", *sys.argv[1:]]))
