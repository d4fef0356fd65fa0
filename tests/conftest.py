"""Test setup: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU runs reproducible and quick on small machines.
torch.set_num_threads(min(torch.get_num_threads(), 2))
