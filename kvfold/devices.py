"""Whether this machine has a GPU torch could use, asked without loading torch where it
cannot have one.

Loading torch costs a process 1.5 s of CPU. A process on a machine with no GPU device
or driver visible (CPU machines, the embedded cluster's simulated nodes) never needs
to pay it to learn the answer. Devices looked for: NVIDIA's, WSL2's (/dev/dxg) and
ROCm's (/dev/kfd), each of which torch.cuda may drive.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def gpu_device_present() -> bool:
    """A GPU device node or driver is visible to this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or any(
        os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")
    )


def cuda_available() -> bool:
    """torch is installed and sees CUDA (torch is loaded only where a device may be)."""
    if not gpu_device_present() or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())
