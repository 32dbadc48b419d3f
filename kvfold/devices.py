"""Whether this machine has CUDA, asked without loading torch where it cannot have any.

Loading torch costs a process 1.5 s of CPU. A process on a machine with no NVIDIA
device or driver (CPU machines, the embedded cluster's simulated nodes) never needs
to pay it to learn the answer.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def nvidia_present() -> bool:
    """An NVIDIA device node or driver is visible to this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia")


def cuda_available() -> bool:
    """torch is installed and sees CUDA (torch is loaded only where a device may be)."""
    if not nvidia_present() or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())
