"""Hardware presets: what one device can do and how devices are connected.

A preset is a YAML file under ``configs/hardware/`` parsed into the frozen :class:`Hardware` dataclass.
Devices are connected by nested *tiers* (for example NVLink inside a node, InfiniBand between nodes):
a tier's ``group_size`` is the number of devices in one group of that tier, each tier's groups are made of
whole groups of the tier below, and the last tier may be unbounded (``group_size: null``) for scale-out.
Every number carries its source in the preset file; nothing here hard-codes a hardware constant.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hyperjax.errors import PresetError, expect
from hyperjax.files import read_yaml
from hyperjax.topology.device import DeviceSpec, is_count, require_name, require_number, require_positive

_TOPOLOGIES = ("switch", "torus", "ring")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tier:
    """One level of the interconnect.

    Attributes:
      name: the tier's name (``node``, ``nvlink``, ``ici``, ...).
      group_size: devices in one group of this tier, or ``None`` for an unbounded scale-out tier.
      bandwidth: bytes/s one direction, per device, for traffic that crosses this tier.
      latency: seconds per message hop on this tier.
      efficiency: achievable fraction of ``bandwidth`` for large collectives, in (0, 1].
      topology: ``switch`` (any-to-any), ``torus`` or ``ring``. For a torus, ``bandwidth`` is what one
        torus dimension with wraparound gives a collective (a bidirectional ring: two links).
      source: where the figures come from.
      torus_dims: a torus's dimensions (2: TPU v5e, 3: TPU v5p); the devices of one group of the tier form
        :meth:`torus_for`'s shape, the fastest dimension first, and a collective over a group spanning
        several dimensions runs on all of them at once. ``None``: the tier is priced as one ring.
      torus_wrap: a dimension at least this long wraps around (TPU v5e: a full 16-chip axis); one without
        wraparound is a line, half a ring's bandwidth.
      torus_wrap_whole: wraparound only where every dimension of the slice reaches ``torus_wrap`` (TPU
        v5p: slices of whole 4 x 4 x 4 cubes).
    """

    name: str
    group_size: int | None
    bandwidth: float
    latency: float
    efficiency: float
    topology: str = "switch"
    source: str
    torus_dims: int | None = None
    torus_wrap: int = 4
    torus_wrap_whole: bool = False

    def __post_init__(self) -> None:
        require_name("tier name", self.name)
        where = f"tier {self.name!r}"
        if self.group_size is not None and not is_count(self.group_size):
            raise PresetError(f"{where}: group_size={self.group_size!r} must be a positive integer or null")
        require_positive(f"{where}.bandwidth", self.bandwidth)
        require_number(f"{where}.latency", self.latency)
        require_number(f"{where}.efficiency", self.efficiency)
        wrap = self.torus_wrap
        if not is_count(wrap):
            raise PresetError(f"{where}: torus_wrap={wrap!r} must be a positive integer (the length that wraps around)")
        if not isinstance(self.torus_wrap_whole, bool):
            raise PresetError(f"{where}: torus_wrap_whole={self.torus_wrap_whole!r} must be true or false")
        if self.latency < 0:
            raise PresetError(f"{where}: latency={self.latency} must be >= 0 seconds")
        if not 0 < self.efficiency <= 1:
            raise PresetError(f"{where}: efficiency={self.efficiency} must be in (0, 1]")
        if self.topology not in _TOPOLOGIES:
            raise PresetError(f"{where}: topology={self.topology!r} must be one of {_TOPOLOGIES}")
        dims = self.torus_dims
        if dims is not None and (self.topology != "torus" or not is_count(dims) or dims not in (1, 2, 3)):
            raise PresetError(f"{where}: torus_dims={self.torus_dims!r} needs topology: torus and 1, 2 or 3 dimensions")

    def torus_for(self, devices: int) -> tuple[tuple[int, bool], ...] | None:
        """``(length, wraps)`` of each torus dimension of a slice of ``devices`` devices, fastest first:
        the most cubic shape of powers of two (TPU slices: 4x4x4, 4x4x8, 16x16, ...), a dimension wrapping
        around when it is at least ``torus_wrap`` long (with ``torus_wrap_whole``, when every one is);
        ``None`` for a tier that is no torus or a device count that is no power of two."""
        if self.torus_dims is None or devices < 1 or devices & (devices - 1):
            return None
        dims = [1] * self.torus_dims
        while math.prod(dims) < devices:
            dims[dims.index(min(dims))] *= 2
        dims.sort()
        whole = min(dims) >= self.torus_wrap or not self.torus_wrap_whole
        return tuple((d, whole and d >= self.torus_wrap) for d in dims)

    @property
    def effective_bandwidth(self) -> float:
        """Achievable bytes/s per device per direction: ``bandwidth * efficiency``."""
        return self.bandwidth * self.efficiency


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostSpec:
    """Host memory reachable from one device (the offload target).

    Attributes:
      bytes_per_device: host memory available to one device, in bytes.
      bandwidth: host<->device bytes/s, one direction.
      latency: seconds per transfer.
      source: where the figures come from.
    """

    bytes_per_device: float
    bandwidth: float
    latency: float
    source: str

    def __post_init__(self) -> None:
        require_positive("host.bytes_per_device", self.bytes_per_device)
        require_positive("host.bandwidth", self.bandwidth)
        require_number("host.latency", self.latency)
        if self.latency < 0:
            raise PresetError(f"host.latency={self.latency} must be >= 0 seconds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """A machine: its device, its interconnect tiers (innermost first) and its host memory.

    Attributes:
      name: the preset's name.
      description: one paragraph about the machine.
      devices: the machine's default device count (one supernode, one slice, a default cluster size).
      device: the accelerator.
      tiers: interconnect tiers, innermost (fastest) first; each group size divides the next.
      host: host memory per device.
      default_axes: mesh axes used when a command is given none, outermost first.
    """

    name: str
    description: str
    devices: int
    device: DeviceSpec
    tiers: tuple[Tier, ...]
    host: HostSpec
    default_axes: Mapping[str, int]

    def __post_init__(self) -> None:
        require_name("name", self.name)
        if not self.tiers:
            raise PresetError(f"preset {self.name!r}: tiers is empty; list at least one interconnect tier")
        names = [t.name for t in self.tiers]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise PresetError(
                f"preset {self.name!r}: two tiers are named {twice!r} ({', '.join(names)}); collectives find a "
                "mesh axis's tiers by name, so give each tier its own"
            )
        sizes = [t.group_size for t in self.tiers]
        for inner, outer, tier in zip(sizes, sizes[1:], self.tiers[1:], strict=False):
            if inner is None:
                raise PresetError(
                    f"preset {self.name!r}: only the last tier may have group_size null, but tier "
                    f"{tier.name!r} comes after an unbounded one"
                )
            if outer is not None and (outer <= inner or outer % inner):
                raise PresetError(
                    f"preset {self.name!r}: tier {tier.name!r} group_size={outer} must be a multiple of the "
                    f"tier below it ({inner}) and larger"
                )
        if not is_count(self.devices):
            raise PresetError(f"preset {self.name!r}: devices={self.devices!r} must be a positive integer")
        axes = self.default_axes
        if not isinstance(axes, Mapping) or not all(is_count(n) for n in axes.values()):
            raise PresetError(
                f"preset {self.name!r}: default_axes={axes!r} must map mesh axes to positive integer degrees, "
                "e.g. {data: 8, tensor: 8}"
            )
        for tier in self.tiers:  # a tier's groups hold whole numbers of devices, or the machine is part of one
            g = tier.group_size
            if g is not None and self.devices > g and self.devices % g:
                raise PresetError(
                    f"preset {self.name!r}: devices={self.devices} is not a whole number of tier {tier.name!r}'s "
                    f"groups of {g} devices; set devices to a multiple of {g} ({self.devices // g * g} or "
                    f"{-(-self.devices // g) * g})"
                )
        top = sizes[-1]
        if top is not None and self.devices > top:
            raise PresetError(
                f"preset {self.name!r}: devices={self.devices} exceeds the outermost tier's group_size={top}; "
                "add an unbounded scale-out tier or lower devices"
            )
        if math.prod(self.default_axes.values()) != self.devices:
            raise PresetError(
                f"preset {self.name!r}: default_axes={dict(self.default_axes)} multiply to "
                f"{math.prod(self.default_axes.values())}, not devices={self.devices}"
            )
        object.__setattr__(self, "default_axes", MappingProxyType(dict(self.default_axes)))

    def __hash__(self) -> int:  # the mappings hash by their items, so a preset can key a cache
        return hash((self.name, self.devices, self.device, self.tiers, self.host, tuple(self.default_axes.items())))

    def to_dict(self) -> dict[str, Any]:
        """The preset as plain JSON-ready data, in the layout of a preset file."""
        return _plain(self)

    @property
    def max_devices(self) -> int | None:
        """The most devices the tiers can connect, or ``None`` when the outermost tier is unbounded."""
        return self.tiers[-1].group_size

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device for ``dtype``.

        Raises:
          PresetError: the preset lists no figure for ``dtype``.
        """
        try:
            return self.device.peak_flops[dtype]
        except KeyError:
            raise PresetError(
                f"preset {self.name!r} has no peak_flops for dtype={dtype!r}; it lists "
                f"{sorted(self.device.peak_flops)}. Add the figure with its source to the preset file."
            ) from None

    def matmul_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device's matrix multiplies in compute ``dtype`` at XLA's default precision.

        ``dtype``'s own peak, or the peak of the dtype ``device.matmul_precision`` says its products run as.
        """
        return self.peak_flops(self.device.matmul_precision.get(dtype, dtype))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        fields = (f for f in dataclasses.fields(value) if f.metadata.get("plain", True))
        return {f.name: _plain(getattr(value, f.name)) for f in fields}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def presets_dir() -> Path:
    """The folder holding the shipped hardware presets.

    Installed wheels carry them inside the package; a source checkout keeps them in ``configs/hardware``.
    """
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "configs" / "hardware", here.parent.parent / "configs" / "hardware"):
        if candidate.is_dir():
            return candidate
    raise PresetError(f"no hardware preset folder found next to {here}; reinstall hyperjax")


def list_presets() -> list[str]:
    """Names of the shipped hardware presets, sorted."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_hardware(preset: str | Path | Hardware) -> Hardware:
    """Load a hardware preset by name (``cloudmatrix384``) or from a YAML file path.

    Args:
      preset: a shipped preset's name or the path of a preset file (a :class:`Hardware` is returned as it is).

    Returns:
      The parsed, validated :class:`Hardware`.

    Raises:
      PresetError: the preset is unknown, the file is malformed, or a value is invalid.
    """
    if isinstance(preset, Hardware):
        return preset
    expect(
        preset, (str, Path), f"hardware preset {preset!r}", "give a preset's name or a preset file's path", PresetError
    )
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        names = list_presets()
        if str(preset) not in names:
            close = difflib.get_close_matches(str(preset), names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PresetError(
                f"unknown hardware preset {str(preset)!r}.{hint} Known presets: {', '.join(names)}; "
                "or pass the path of a preset YAML file."
            )
        path = presets_dir() / f"{preset}.yaml"
    if not path.is_file():
        raise PresetError(f"hardware preset file {str(path)!r} does not exist; pass an existing YAML file")
    raw = read_yaml(path, what="hardware preset file", error=PresetError)
    return hardware_from_dict(raw, where=str(path))


def hardware_from_dict(raw: Any, *, where: str = "preset") -> Hardware:
    """Build :class:`Hardware` from the parsed YAML mapping of a preset file.

    Raises:
      PresetError: a key is missing or unknown, or a value is invalid.
    """
    if raw is None:
        raise PresetError(f"{where} is empty; a preset gives {', '.join(_required(Hardware))} (see {presets_dir()})")
    try:
        raw = _mapping(raw, "the preset", Hardware)
        device = DeviceSpec(**_fields(DeviceSpec, _mapping(raw.get("device"), "device", DeviceSpec), "device"))
        listed = raw.get("tiers") or []
        if not isinstance(listed, list):
            raise PresetError(f"tiers={listed!r} must be a list of tier mappings, innermost first")
        tiers = tuple(
            Tier(**_fields(Tier, _mapping(t, f"tiers[{i}]", Tier), f"tiers[{i}]")) for i, t in enumerate(listed)
        )
        host = HostSpec(**_fields(HostSpec, _mapping(raw.get("host"), "host", HostSpec), "host"))
        top = {k: v for k, v in raw.items() if k not in ("device", "tiers", "host")}
        return Hardware(
            device=device, tiers=tiers, host=host, **_fields(Hardware, top, None, skip=("device", "tiers", "host"))
        )
    except PresetError as e:
        raise PresetError(f"{where}: {e}") from None


def _required(cls: type) -> list[str]:
    """The fields of ``cls`` that have no default: what its part of a preset must give."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def _mapping(value: Any, where: str, cls: type) -> dict[str, Any]:
    if value is None:
        raise PresetError(f"{where} is missing; it is a mapping of {', '.join(_required(cls))}")
    if not isinstance(value, dict):
        raise PresetError(f"{where} must be a mapping of {', '.join(_required(cls))}, got {type(value).__name__}")
    return value


def _fields(cls: type, raw: dict[str, Any], where: str | None, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    at = f"{where}: " if where else ""
    allowed = [f.name for f in dataclasses.fields(cls)]  # ``skip``: read by the caller, allowed all the same
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    unknown = sorted(map(str, set(raw) - set(fields)))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PresetError(f"{at}unknown key {unknown[0]!r}{hint}; allowed keys: {', '.join(allowed)}")
    required = [n for n in _required(cls) if n not in skip]
    missing = [n for n in required if n not in raw]
    if missing:
        raise PresetError(f"{at}missing key {missing[0]!r}; required keys: {', '.join(required)}")
    return dict(raw)
