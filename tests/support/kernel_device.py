"""The device of the Triton kernel tests: CUDA, or the CPU under the Triton interpreter.

``OPAKE_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs the kernel tests through the interpreter on CPU.
Import :func:`kernel_device` into a test module: as an autouse fixture it skips the module's tests where the kernels
cannot launch.
"""

from __future__ import annotations

import os

import pytest
import torch

from opake_torch.patches.kernels._triton import can_launch

DEVICE = os.environ.get("OPAKE_KERNEL_TEST_DEVICE", "cuda")


@pytest.fixture(autouse=True)
def kernel_device() -> str:
    """``DEVICE``, after skipping the test where the kernels cannot launch on it."""
    if not can_launch(torch.empty(0, device=DEVICE if DEVICE == "cpu" or torch.cuda.is_available() else "cpu")):
        pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with OPAKE_KERNEL_TEST_DEVICE=cpu)")
    return DEVICE
