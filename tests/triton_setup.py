"""Imported first by the kernel tests. Without a GPU they run Triton under its interpreter,
which must be switched on before triton is imported (``@triton.jit`` reads TRITON_INTERPRET
at decoration time); with a GPU the same tests run natively, in bfloat16 too."""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
