"""Intel Extension for PyTorch: end-of-life (last release 2.8, pinned to torch 2.8). Only a clear refusal lives here."""
from __future__ import annotations

from kvexport.errors import BackendUnavailableError


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def require_ipex() -> None:
    """Raise BackendUnavailableError unless IPEX is importable and built for the installed torch."""
    import torch

    try:
        import intel_extension_for_pytorch as ipex  # type: ignore[import-not-found]
    except ImportError as e:
        raise BackendUnavailableError(
            "Intel Extension for PyTorch is not installed. It is end-of-life (last release 2.8, pinned to "
            "torch 2.8, repository archived); kvexport's intel target runs on OpenVINO instead: drop "
            "--option engine=... to build the OpenVINO engine"
        ) from e
    if _major_minor(ipex.__version__) != _major_minor(torch.__version__):
        raise BackendUnavailableError(
            f"intel_extension_for_pytorch {ipex.__version__} is built for torch "
            f"{'.'.join(map(str, _major_minor(ipex.__version__)))}, but torch {torch.__version__} is installed; "
            "IPEX is end-of-life and will not follow newer torch: use the OpenVINO engine (the default)"
        )
