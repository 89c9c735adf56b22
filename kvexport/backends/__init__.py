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


WEIGHT_MODES = ("fp32", "fp16", "bf16", "int8", "int4")  # --weights (and its alias --precision)
KV_MODES = ("fp32", "fp16", "bf16", "int8")  # --kv
GROUP_SIZES = (32, 64, 128)  # --group-size: the block of int8/int4 weights sharing one scale
BLOCK_MODES = ("int8", "int4")  # the weight modes that take a group size
OptionKind = Literal["bool", "int", "str"]


@dataclass(frozen=True)
class Option:
    """One `--option NAME=VALUE` a backend takes, declared once; core parses and validates it."""

    name: str
    kind: OptionKind
    default: Any
    help: str
    choices: tuple[str, ...] = ()  # str options: the values it takes (empty: any)
    phase: Literal["build", "load", "both"] = "build"  # `kvexport build --option`, or kvexport.load(**options)

    def described(self) -> str:
        """The option as an error lists what a target takes."""
        return f"{self.name} ({self.kind}, default {self.default!r}): {self.help}"


@dataclass(frozen=True)
class AutoMode:
    """One entry of a backend's `auto` preference: the modes and why they come at this place."""

    weights: str
    kv: str
    reason: str
    group_size: int | None = None


@dataclass(frozen=True)
class Capabilities:
    """What shared code may ask of a backend (never `if target == ...`)."""

    name: str
    description: str
    ir_cache_style: Literal["static", "concat"]  # the IR style it lowers from
    cache_policy: CachePolicy  # grow: runtime doubles capacity; fixed: max_seq; internal: engine-owned state
    precisions: tuple[str, ...]  # the weight modes it builds (--weights), a subset of WEIGHT_MODES
    default_precision: str  # the weights mode when --weights is not given
    devices: tuple[str, ...]
    sdk: tuple[str, ...] = ()  # Python modules the backend needs at build/run time
    deferred_build: bool = False  # can package the IR and build the engine at first load
    threads_option: bool = True
    kv_modes: tuple[str, ...] = ("fp32",)  # the KV-cache modes it builds (--kv), a subset of KV_MODES
    # int8/int4 block sizes it builds, and the one it takes when --group-size is not given
    group_sizes: tuple[int, ...] = GROUP_SIZES
    default_group_size: dict[str, int] = field(default_factory=lambda: {"int8": 32, "int4": 32})
    kv_follows_weights: bool = False  # with no --kv, the cache takes the weights' float type (else fp32)
    # sliding-window layers keep a ring of window slots (IR: TensorScatter mode=circular); False: full length
    ring_cache: bool = False
    # loading may rebuild the engine for this device or SDK, which the load option no_rebuild (`--no-rebuild`) turns
    # into an error; a backend that never rebuilds at load satisfies no_rebuild as it is, and core drops it
    rebuilds_at_load: bool = False
    options: tuple[Option, ...] = ()  # its --option keys (see Option)
    # an option that is another name for a core flag: {option: (flag, {its value: the flag's value})}
    option_aliases: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)


@dataclass
class BuildOptions:
    precision: str | None = None  # None: the backend's default for this device (the weights' mode; see `weights`)
    # The one precision vocabulary of every target (`kvexport build --weights/--group-size/--kv`).
    # weights: fp32|fp16|bf16|int8|int4 (None: the backend's default; core resolves "auto" before build)
    weights: str | None = None
    group_size: int | None = None  # block size of int8/int4 weights (32|64|128); None: the backend's default
    # set by core: the group size is the default, not asked for, so a backend may fit each matrix's block to
    # its rows (narrower where the default does not divide them) rather than pad it
    fit_blocks: bool = False
    kv: str | None = None  # KV cache: fp32|fp16|bf16|int8 (None: fp32)
    # a sample of the model's own text, for what the build calibrates (int8 KV scales); build() passes
    # the checkpoint's held-out text when it ships one; None: the backend's built-in sample
    calibration_text: str | None = None
    max_batch: int = 8
    threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (numa_node, kv_precision, ...)


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def parse_bool(name: str, value: Any) -> bool:
    """The one rule for a boolean option, on every target: true/false/1/0/yes/no/on/off, nothing else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise InputError(f"option {name} is true or false ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}), "
                     f"not {value!r}")


def parse_option(option: Option, value: Any) -> Any:
    """One declared option's value, typed; None keeps the default's meaning (not set)."""
    if value is None:
        return None
    if option.kind == "bool":
        return parse_bool(option.name, value)
    if option.kind == "int":
        if isinstance(value, bool):
            raise InputError(f"option {option.name} takes an integer, not {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError) as e:
            raise InputError(f"option {option.name} takes an integer, got {value!r} ({option.help})") from e
    text = str(value)
    if option.choices and text.lower() not in option.choices:
        raise InputError(f"option {option.name} is one of {', '.join(option.choices)}, not {value!r} ({option.help})")
    return text.lower() if option.choices else text


def parse_options(declared: tuple[Option, ...], given: dict[str, Any], *, target: str,
                  phase: Literal["build", "load"]) -> dict[str, Any]:
    """`given` checked against what the target declares for this phase: every declared option with its
    typed value (its default when not given). Unknown names list the ones it takes."""
    known = {o.name: o for o in declared if o.phase in (phase, "both")}
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = "; ".join(o.described() for o in known.values())
        raise InputError(f"unknown {target} options {unknown} at {phase}; the {target} target takes "
                         + (takes or f"no --option at {phase}"))
    out = {}
    for name, option in known.items():
        value = parse_option(option, given.get(name))
        out[name] = option.default if value is None else value
    return out


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
        if manifest.cache.get("ring") and not caps.ring_cache:
            return [f"{self.name} keeps full-length caches and this IR keeps its sliding-window layers on ring caches; "
                    "export it without rings (kvexport build picks the right one for you)"]
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
        return self.open_session(Path(folder), manifest, **self.load_options(options))

    def load_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The load options given (kvexport.load's keywords, `--option` and the CLI's flags) checked against what
        the target declares for loading, typed; unknown names list what it takes. Core's own: threads (where the
        target takes a thread count), no_rebuild (dropped where loading never rebuilds: it holds already) and
        progress (where an engine may be built at first load)."""
        caps = self.capabilities()
        given = dict(options)
        if not caps.rebuilds_at_load:
            given.pop("no_rebuild", None)
        if given.get("threads") is None:
            given.pop("threads", None)  # kvexport.load passes threads=None when not asked
        elif not caps.threads_option:
            raise InputError(f"the {self.name} target sets no thread count (it runs on {', '.join(caps.devices)}): "
                             "drop threads / --threads")
        declared = {o.name: o for o in caps.options if o.phase in ("load", "both")}
        core = {"threads": "threads (int): CPU threads"} if caps.threads_option else {}
        if caps.rebuilds_at_load:
            core["no_rebuild"] = "no_rebuild (bool): fail instead of rebuilding the engine for this device or SDK"
        if caps.deferred_build:
            core["progress"] = "progress (callable): what a build at first load reports to"
        unknown = sorted(set(given) - set(declared) - set(core))
        if unknown:
            takes = [*core.values(), *(o.described() for o in declared.values())]
            raise InputError(f"unknown {self.name} load options {unknown}; the {self.name} target takes "
                             + "; ".join(takes))
        return {k: parse_option(declared[k], v) if k in declared else v for k, v in given.items()}

    @abstractmethod
    def open_session(self, folder: Path, manifest: Manifest, **options: Any) -> Any:
        """Return a kvexport.runtime.session.Session over the built engine. Called only after every
        file of the artifact matched its sha256 in the manifest."""

    def doctor(self) -> dict[str, Any]:
        """Facts for `kvexport doctor` (SDK versions, devices)."""
        return {}

    def build_options(self, options: BuildOptions) -> dict[str, Any]:
        """options.extra checked against the declared build options, typed, defaults filled in. Core calls
        it before any long work; a backend's build calls it again (it is idempotent) to read its options."""
        caps = self.capabilities()
        given = {k: v for k, v in options.extra.items() if k not in caps.option_aliases}
        return parse_options(caps.options, given, target=self.name, phase="build")

    def rings_off(self, options: BuildOptions) -> str | None:
        """Why this build keeps sliding-window layers at full length although the target runs ring caches
        (Capabilities.ring_cache), given the resolved options; None: rings where the model slides."""
        return None

    def weight_bytes(self, folder: Path, manifest: Manifest, weights: str, group_size: int | None) -> int:
        """Bytes of the engine's weights (scales included), for the manifest's target.weights. This default
        estimates from the parameter count; a backend that can count its engine's tensors overrides it."""
        from kvexport.precision import nominal_weight_bytes

        return nominal_weight_bytes(manifest.raw["model"]["num_parameters"], weights, group_size)

    def kv_bytes_per_token(self, manifest: Manifest, kv: str) -> int:
        """Cache bytes one token adds (K and V, every layer, scales included), for target.kv. The default
        int8 scheme is per token and head with an f32 scale and zero point (OpenVINO's u8 cache); a backend
        whose scales are per channel (fixed, not per token) overrides it."""
        from kvexport.precision import default_kv_bytes_per_token

        return default_kv_bytes_per_token(manifest, kv)

    def auto_modes(self, flags: set[str]) -> list[AutoMode]:
        """`--weights auto` / `--kv auto`: this backend's modes in the order it runs them fastest on a CPU
        with these ISA flags (/proc/cpuinfo names). Core takes the first that the asked-for flags allow
        and that has a tolerance row. The default: the default weights with an fp32 cache."""
        caps = self.capabilities()
        return [AutoMode(caps.default_precision, "fp32", f"{caps.default_precision}: the {self.name} default")]

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
