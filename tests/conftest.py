import os

import torch

# Triton kernels run under the interpreter on a machine without a GPU (fp32/fp16 only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
