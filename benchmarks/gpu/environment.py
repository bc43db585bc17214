"""What run_all.py records of the machine, as one JSON object on stdout: Python, torch and its CUDA,
the GPU's name, and the flash-attn packages installed."""
from __future__ import annotations

import json
import platform
from importlib import metadata


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    import torch

    import packctl

    cuda = torch.cuda.is_available()
    flash = [f"{name} {version(name)}" for name in ("flash-attn", "flash-attn-4", "nvidia-cutlass-dsl")
             if version(name)]
    print(json.dumps({
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "flash_attn": ", ".join(flash) or None, "packctl": packctl.__version__,
    }))


if __name__ == "__main__":
    main()
