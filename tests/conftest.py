import os
import sys

import torch

# the tests import the project's modules (model, kernels, ...) from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels can only run on CPU tensors under Triton's interpreter, which
# must be switched on before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
