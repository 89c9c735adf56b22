"""The backend plug-in interface and registry (entry-point group `kvexport.backends`).

A backend is imported only when it is used, so `kvexport --help` stays fast and a backend whose
vendor SDK is missing still imports and says why it cannot build.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Literal

from kvexport.errors import BackendUnavailableError, InputError, KvexportError
from kvexport.manifest import Manifest

GROUP = "kvexport.backends"
Progress = Callable[[str], None]
CachePolicy = Literal["grow", "fixed", "internal"]


@dataclass(frozen=True)
class Capabilities:
    """What shared code may ask of a backend (never `if target == ...`)."""

    name: str
    description: str
    ir_cache_style: Literal["static", "concat"]  # the IR style it lowers from
    cache_policy: CachePolicy  # grow: runtime doubles capacity; fixed: max_seq; internal: engine-owned state
    precisions: tuple[str, ...]
    default_precision: str
    devices: tuple[str, ...]
    sdk: tuple[str, ...] = ()  # Python modules the backend needs at build/run time
    deferred_build: bool = False  # can package the IR and build the engine at first load
    threads_option: bool = True


@dataclass
class BuildOptions:
    precision: str | None = None  # None: the backend's default for this device (the weights' mode; see `weights`)
    # The one precision vocabulary of every target (`kvexport build --weights/--group-size/--kv`).
    # weights: fp32|fp16|bf16|int8|int4 (None: the backend's default; core resolves "auto" before build)
    weights: str | None = None
    group_size: int | None = None  # block size of int8/int4 weights (32|64|128); None: the backend's default
    kv: str | None = None  # KV cache: fp32|fp16|bf16|int8 (None: fp32)
    max_batch: int = 8
    threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (numa_node, kv_precision, ...)


class Backend(ABC):
    """One hardware target. Subclasses import their SDK inside methods, never at module level."""

    name: str = ""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def availability(self) -> list[str]:
        """Why this backend cannot build or run here (empty list: it can). Cheap; imports nothing heavy."""

    def check(self, manifest: Manifest) -> list[str]:
        """Problems with lowering this IR (unsupported dtype, style, ...). Empty list: fine."""
        caps = self.capabilities()
        if manifest.raw["ir"]["cache_style"] != caps.ir_cache_style:
            return [f"{self.name} lowers the {caps.ir_cache_style}-cache IR; this artifact holds "
                    f"the {manifest.raw['ir']['cache_style']} one (kvexport build picks the right one for you)"]
        return []

    @abstractmethod
    def build(self, folder: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
        """Write engine files under folder/'engine' and set manifest.raw['target'] (hashes are added after)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "load" in cls.__dict__:
            raise TypeError(f"{cls.__name__} overrides Backend.load, which checks the artifact's files before "
                            "any engine file is opened; implement open_session instead")

    def load(self, folder: Path, manifest: Manifest, **options: Any) -> Any:
        """Check every file of the artifact against the manifest (kvexport.artifact.check_integrity),
        then open the engine (open_session). One check for every backend, and no way around it."""
        from kvexport.artifact import check_integrity

        check_integrity(Path(folder), manifest)
        return self.open_session(Path(folder), manifest, **options)

    @abstractmethod
    def open_session(self, folder: Path, manifest: Manifest, **options: Any) -> Any:
        """Return a kvexport.runtime.session.Session over the built engine. Called only after every
        file of the artifact matched its sha256 in the manifest."""

    def doctor(self) -> dict[str, Any]:
        """Facts for `kvexport doctor` (SDK versions, devices)."""
        return {}

    def require_available(self) -> None:
        reasons = self.availability()
        if reasons:
            raise BackendUnavailableError(f"target {self.name!r} cannot run here: " + "; ".join(reasons))


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise KvexportError(
                f"two packages register backend {ep.name!r} ({found[ep.name].value} and {ep.value}); "
                "uninstall one of them"
            )
        found[ep.name] = ep
    return found


def names() -> list[str]:
    return sorted(_entry_points())


_cache: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """Instantiate a registered backend; unknown names list the registered ones."""
    if name in _cache:
        return _cache[name]
    eps = _entry_points()
    if name not in eps:
        raise InputError(
            f"unknown target {name!r}; registered targets: {', '.join(sorted(eps)) or 'none'} "
            "(is kvexport installed with `pip install -e .`?)"
        )
    try:
        cls = eps[name].load()
    except (ImportError, AttributeError) as e:
        raise BackendUnavailableError(
            f"target {name!r} failed to load from {eps[name].value} ({e}); reinstall kvexport (pip install -e .)"
        ) from e
    backend = cls()
    _cache[name] = backend
    return backend
