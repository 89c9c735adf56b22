"""The precision vocabulary of every target: `--weights/--group-size/--kv`, their aliases, `auto`, and the record."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvexport.backends import BLOCK_MODES, GROUP_SIZES, KV_MODES, WEIGHT_MODES, AutoMode, BuildOptions
from kvexport.errors import InputError
from kvexport.tolerances import DTYPE_NAMES, TOLERANCES, mode_key

if TYPE_CHECKING:
    from kvexport.backends import Backend
    from kvexport.manifest import Manifest

ALIASES = {**DTYPE_NAMES, "i8": "int8", "q8": "int8", "q4": "int4"}
ITEM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Resolved:
    """What a build makes: the weights' mode (None: the backend's default) and block, the cache's mode, and
    `auto`'s pick if it chose."""

    weights: str | None
    group_size: int | None
    kv: str
    auto: AutoMode | None = None

def canonical(value: str) -> str:
    word = str(value).strip().lower()
    return ALIASES.get(word, word)


def _mode(flag: str, what: str, value: str | None, vocabulary: tuple[str, ...], supported: tuple[str, ...],
          target: str) -> str | None:
    if value is None:
        return None
    mode = canonical(value)
    if mode == "auto":
        return mode
    if mode not in vocabulary:
        raise InputError(f"{flag} is one of {', '.join(vocabulary)} or auto, not {value!r}")
    if mode not in supported:
        raise InputError(f"target {target!r} builds {what} precisions {', '.join(supported)} ({flag} one of "
                         f"those, or auto), not {mode}; pick one of those or another --target")
    return mode


def resolve(backend: Backend, options: BuildOptions, flags: set[str],
            say: Any = lambda _m: None) -> Resolved:
    """Check the asked-for modes against what the target builds and settle `auto`, before any long work.
    Writes the result back into options (weights, precision, group_size, kv)."""
    caps, target = backend.capabilities(), backend.name
    if options.precision is not None and options.weights is not None \
            and canonical(options.precision) != canonical(options.weights):
        raise InputError(f"--precision is another name for --weights; got --precision {options.precision} and "
                         f"--weights {options.weights}: pass one")
    group = options.group_size
    if group is not None and group not in GROUP_SIZES:
        raise InputError(f"--group-size is one of {', '.join(map(str, GROUP_SIZES))}, not {group}")
    kv_asked = options.kv
    for name, (flag, values) in caps.option_aliases.items():
        if name not in options.extra:
            continue
        raw = str(options.extra[name]).lower()
        if raw not in values:
            raise InputError(f"--option {name} is one of {', '.join(values)} (another name for --{flag}), not {raw!r}")
        if kv_asked is not None and canonical(kv_asked) != values[raw]:
            raise InputError(f"--option {name}={raw} is --{flag} {values[raw]}, and --{flag} {kv_asked} was given too: "
                             "pass one")
        options.extra[name] = raw  # kept for the backend: two of its spellings may be one mode (intel's u8 and i8)
        kv_asked = values[raw]
        say(f"--option {name}={raw} is a --{flag} {values[raw]} cache (--{flag} is its name on every target)")
    weights = _mode("--weights", "weight", options.weights or options.precision, WEIGHT_MODES, caps.precisions, target)
    kv = _mode("--kv", "KV-cache", kv_asked, KV_MODES, caps.kv_modes, target)
    if group is not None:
        if weights not in (*BLOCK_MODES, "auto"):
            raise InputError(f"--group-size applies to --weights {' or '.join(BLOCK_MODES)}, not "
                             f"{weights or caps.default_precision}")
        if group not in caps.group_sizes:
            raise InputError(f"target {target!r} builds group sizes {', '.join(map(str, caps.group_sizes))}, not {group}")
    pick = None
    if "auto" in (weights, kv):
        pick = _pick(backend, flags, weights, kv, group)
        weights, kv, group = pick.weights, pick.kv, pick.group_size if group is None else group
        say(f"auto: --weights {weights} --kv {kv}" + (f" --group-size {group}" if group else "")
            + f": {pick.reason}")
    # not asked for: options.weights stays None and the backend takes its default (which may depend on the
    # device it finds); record() reads the mode it built from the target it wrote
    built = weights or caps.default_precision
    if kv is None:  # a target that keeps its cache in the model's dtype keeps it in the weights' float type,
        # and under int8/int4 weights in its first KV mode (the float type they dequantize into)
        kv = ("fp32" if not caps.kv_follows_weights
              else built if built in caps.kv_modes and built not in BLOCK_MODES else caps.kv_modes[0])
        if kv not in caps.kv_modes:
            kv = caps.kv_modes[0]
    if built in BLOCK_MODES and group is None:
        group = caps.default_group_size[built]
    options.weights = options.precision = weights
    options.fit_blocks = options.group_size is None and group is not None
    options.group_size, options.kv = group, kv
    return Resolved(weights, group, kv, pick)


def _pick(backend: Backend, flags: set[str], weights: str | None, kv: str | None, group: int | None) -> AutoMode:
    caps = backend.capabilities()
    tried = []
    for m in backend.auto_modes(flags):
        g = m.group_size if m.group_size is not None else (
            group or (caps.default_group_size.get(m.weights) if m.weights in BLOCK_MODES else None))
        fits = (weights in (None, "auto", m.weights) and kv in (None, "auto", m.kv)
                and (group is None or m.weights not in BLOCK_MODES or g == group))
        if fits and (backend.name, mode_key(m.weights, g, m.kv)) in TOLERANCES:
            return AutoMode(m.weights, m.kv, m.reason, g)
        tried.append(mode_key(m.weights, g, m.kv))
    raise InputError(f"auto found no mode for target {backend.name!r} that fits --weights {weights or 'default'} "
                     f"--kv {kv or 'default'} and has a tolerance row (its preference here: {', '.join(tried)}); "
                     "name the modes instead")


def record(backend: Backend, folder: Any, manifest: Manifest, resolved: Resolved) -> None:
    """The manifest target's precision record: `precision` (the weights' mode), `weights: {dtype, group_size,
    bytes}`, `kv: {dtype, bytes_per_token}` and `auto: {weights, kv, reason}` when auto chose. A backend that
    counted its bytes (or quantized its own cache) has set `weights` / `kv` already; they are kept."""
    target = manifest.raw["target"]
    weights = target["precision"] = resolved.weights or target["precision"]
    if "weights" not in target:
        target["weights"] = {"dtype": weights, "group_size": resolved.group_size,
                             "bytes": backend.weight_bytes(folder, manifest, weights, resolved.group_size)}
    if "kv" not in target:
        target["kv"] = {"dtype": resolved.kv, "bytes_per_token": backend.kv_bytes_per_token(manifest, resolved.kv)}
    if resolved.auto is not None:
        target["auto"] = {"weights": weights, "group_size": resolved.group_size, "kv": resolved.kv,
                          "reason": resolved.auto.reason}


def nominal_weight_bytes(num_parameters: int, weights: str, group_size: int | None) -> int:
    """Every parameter at the mode's width, plus one fp16 scale per block: what a backend that does not count
    its engine's tensors records."""
    scales = num_parameters // group_size * 2 if weights in BLOCK_MODES and group_size else 0
    return int(num_parameters * ITEM_BYTES[weights]) + scales


def kv_elements_per_token(manifest: Manifest) -> int:
    """K and V elements one token adds to the cache, every layer."""
    cfg = manifest.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


def default_kv_bytes_per_token(manifest: Manifest, kv: str) -> int:
    """K and V at the mode's width; int8 with an f32 scale and zero point per token and head."""
    elements = kv_elements_per_token(manifest)
    scales = elements // manifest.config.head_dim * 8 if kv == "int8" else 0
    return int(elements * ITEM_BYTES[kv]) + scales


def kv_of(manifest: Manifest) -> tuple[str, int]:
    """(mode, bytes per token) of an artifact's cache: its target's record; for an artifact built before it,
    intel's options.kv_precision or else the IR's cache dtype."""
    target = manifest.target or {}
    if target.get("kv"):
        return canonical(target["kv"]["dtype"]), int(target["kv"]["bytes_per_token"])
    legacy = (target.get("options") or {}).get("kv_precision")
    mode = canonical(legacy) if legacy else canonical(manifest.cache["dtype"])
    return mode, default_kv_bytes_per_token(manifest, mode)
