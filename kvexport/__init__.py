"""kvexport: decoder-only LLMs -> ONNX IR with an explicit KV cache -> per-vendor engines."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvexport.runtime.engine import Engine

from kvexport.errors import (  # noqa: E402
    ArtifactError,
    BackendUnavailableError,
    CheckpointError,
    ContextOverflowError,
    InputError,
    KvexportError,
    ManifestError,
    NumericsMismatchError,
    UnsupportedArchitectureError,
    UnsupportedFeatureError,
    WeightShapeError,
)


def load(path: str, **options: object) -> Engine:
    """Load an artifact folder and return an Engine (see kvexport.runtime.engine)."""
    from kvexport.runtime.engine import load as _load

    return _load(path, **options)  # type: ignore[arg-type]


__all__ = [
    "ArtifactError", "BackendUnavailableError", "CheckpointError", "ContextOverflowError", "InputError",
    "KvexportError", "ManifestError", "NumericsMismatchError", "UnsupportedArchitectureError",
    "UnsupportedFeatureError", "WeightShapeError", "load", "__version__",
]
