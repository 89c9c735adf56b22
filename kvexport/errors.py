"""The typed error hierarchy: every failure a user can cause says what failed and what to do."""
from __future__ import annotations


class KvexportError(Exception):
    """Base of every error kvexport raises on purpose. The CLI prints these without a traceback."""

    exit_code = 2


class UnsupportedArchitectureError(KvexportError):
    """The checkpoint's `model_type` has no entry in the architecture table."""


class UnsupportedFeatureError(KvexportError):
    """The family is known but a config field asks for something the owned decoder lacks."""


class CheckpointError(KvexportError):
    """The checkpoint folder is missing files or holds tensors that do not fit the config."""


class WeightShapeError(CheckpointError):
    """A tensor in the checkpoint has a shape the config does not predict."""


class ArtifactError(KvexportError):
    """An artifact folder is missing, corrupted, edited or from a newer schema."""


class ManifestError(ArtifactError):
    """manifest.json does not validate against the schema this runtime knows."""


class ContextOverflowError(KvexportError):
    """A request needs more cache slots than the engine's max_seq."""


class InputError(KvexportError):
    """Bad arguments to the runtime: wrong dtype, empty prompt, bad sampling parameters."""


class BackendUnavailableError(KvexportError):
    """The target's SDK or device is missing on this machine."""

    exit_code = 3


class NumericsMismatchError(KvexportError):
    """The engine's output differs from the PyTorch reference beyond the tolerance table."""

    exit_code = 4


class ReferenceMismatchError(CheckpointError):
    """The reference checkpoint given to verify is not the model the artifact was built from."""


class ReferenceUnavailableError(KvexportError):
    """verify's reference implementation (`transformers`) is not installed here."""

    exit_code = 3
