"""One accelerator: its peaks, memory, and the rates its kernels reach (parsed from a preset's ``device``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hyperjax.errors import PresetError


def require_number(key: str, value: Any, what: str = "a finite number") -> None:
    """A preset's number: an int or a float, finite (YAML 1.1 reads ``1e9`` as text: ``1.0e+9`` is a number)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        hint = " (YAML reads 1e9 as text: write 1.0e+9)" if isinstance(value, str) else ""
        raise PresetError(f"{key}={value!r} must be {what}{hint}")


def is_count(value: Any, least: int = 1) -> bool:
    """Whether a preset's ``value`` is a whole number (not a boolean, which YAML's ``true`` is) of ``least`` or more."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_fraction(value: Any) -> bool:
    """Whether a preset's ``value`` is a number in (0, 1]: a share of a peak or of a rate."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1


def require_name(key: str, value: Any) -> None:
    """A preset's name of something (a preset, a device, a tier): a non-empty string."""
    if not isinstance(value, str) or not value:
        raise PresetError(f"{key}={value!r} must be a non-empty string")


def require_positive(key: str, value: Any) -> None:
    require_number(key, value, "a positive number")
    if not value > 0:
        raise PresetError(f"{key}={value!r} must be a positive number")


DTYPES = ("bfloat16", "float16", "float32", "tf32", "fp8", "int8")
"""The dtypes a preset's ``device.peak_flops`` may price."""


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class MeasuredWidth:
    """A fused attention kernel's long-sequence forward and backward fractions of the peak at one more head
    width than its own (``widths`` of :class:`AttentionKernel`; the same ``seq_half``)."""

    head_dim: int
    forward: float
    backward: float


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class AttentionKernel:
    """A fused attention kernel's measured rates (causal): the forward's and the backward's fractions of the
    peak the compute dtype's products run at, at long sequences, and the keys at which each reaches half of
    that (each block of queries pays a fixed prologue and epilogue: the rate over ``seq`` keys is the
    long-sequence rate times ``seq / (seq + seq_half)``). The backward multiplies 2.5 times the forward's
    FLOPs. ``head_dim``: the head width the rates were measured at. ``overlapped``: the kernel runs each
    score's exponential beside its products (Hopper's warp-specialised kernels), so they cost nothing while
    the products take longer; otherwise one after the other (:meth:`DeviceSpec.attention_rates`).
    ``widths``: the rates measured at other head widths (a kernel's tiles and registers change with the
    width, which the exponentials alone do not capture).
    """

    forward: float
    backward: float
    seq_half: float = 0.0
    head_dim: int = 128
    overlapped: bool = False
    widths: tuple[MeasuredWidth, ...] = ()
    name: str = dataclasses.field(default="attention kernel", compare=False, metadata={"plain": False})

    def __post_init__(self) -> None:
        widths = tuple(self.widths or ())
        for i, w in enumerate(widths):
            if not isinstance(w, MeasuredWidth):
                raise PresetError(f"{self.name}.widths[{i}]={w!r} must be a measured width of {', '.join(WIDTH_KEYS)}")
            require_positive(f"{self.name}.widths[{i}].head_dim", w.head_dim)
        for where, w in (("", self), *((f".widths[{i}]", w) for i, w in enumerate(widths))):
            for key in ("forward", "backward"):
                value = getattr(w, key)
                if not is_fraction(value):
                    raise PresetError(f"{self.name}{where}.{key}={value!r} must be a fraction of the peak in (0, 1]")
        object.__setattr__(self, "widths", tuple(sorted(widths)))  # the same widths in any order: one kernel
        require_number(f"{self.name}.seq_half", self.seq_half, "a finite number of keys >= 0")
        if self.seq_half < 0:
            raise PresetError(f"{self.name}.seq_half={self.seq_half!r} must be >= 0 keys")
        require_positive(f"{self.name}.head_dim", self.head_dim)
        if not isinstance(self.overlapped, bool):
            raise PresetError(f"{self.name}.overlapped={self.overlapped!r} must be true or false")
        heads = [w.head_dim for w in self.measured()]
        if len(set(heads)) < len(heads):
            raise PresetError(f"{self.name}.widths measure head_dim {heads}: each width once, not head_dim's own")

    def measured(self) -> list[MeasuredWidth]:
        """Every measured width, its own among the ``widths``, narrowest first."""
        own = MeasuredWidth(head_dim=self.head_dim, forward=self.forward, backward=self.backward)
        return sorted([own, *self.widths])


KERNEL_KEYS = ("forward", "backward", "seq_half", "head_dim", "overlapped", "widths")
WIDTH_KEYS = ("head_dim", "forward", "backward")


def per_score(w: MeasuredWidth) -> tuple[tuple[int, float], tuple[int, float]]:
    """``(product FLOPs per score, measured rate)`` of the forward and of the backward at width ``w``."""
    return (4 * w.head_dim, w.forward), (10 * w.head_dim, w.backward)


def _width(where: str, raw: Any) -> MeasuredWidth:
    if isinstance(raw, MeasuredWidth):
        return raw
    if not isinstance(raw, Mapping) or set(raw) != set(WIDTH_KEYS):
        raise PresetError(f"{where}={raw!r} must be a mapping of exactly {', '.join(WIDTH_KEYS)}")
    return MeasuredWidth(**raw)  # its values are checked with the kernel's


def _kernel(name: str, raw: Any) -> AttentionKernel:
    where = f"device.attention_kernels.{name}"
    if isinstance(raw, AttentionKernel):
        return raw
    if not isinstance(raw, Mapping) or set(raw) - set(KERNEL_KEYS) or not {"forward", "backward"} <= set(raw):
        raise PresetError(
            f"{where}={raw!r} must be a mapping with forward and backward (fractions of the peak) and optionally "
            f"{', '.join(KERNEL_KEYS[2:])}"
        )
    widths = raw.get("widths") or ()
    if not isinstance(widths, list | tuple):
        raise PresetError(f"{where}.widths={widths!r} must be a list of measured widths")
    widths = tuple(_width(f"{where}.widths[{i}]", w) for i, w in enumerate(widths))
    return AttentionKernel(name=where, **{**raw, "widths": widths})


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator.

    Attributes:
      name: the device's product name.
      peak_flops: dense peak FLOP/s per dtype name (``bfloat16``, ``float32``, ...).
      hbm_bytes: device memory in bytes.
      hbm_bandwidth: device memory bandwidth in bytes/s.
      matmul_efficiency: achievable fraction of peak FLOP/s for large matrix multiplies.
      format_efficiency: a format's own achievable fraction of its peak, where its products reach a
        different one than ``matmul_efficiency`` (``{fp8: 0.62}``); see :meth:`efficiency`.
      memory_efficiency: achievable fraction of ``hbm_bandwidth`` for streaming (element-wise) work.
      kernel_overhead: seconds each launched operator costs beyond its roofline time.
      source: where the figures come from.
      matmul_precision: for a compute dtype whose matrix multiplies run at another dtype's rate under
        XLA's default precision, that dtype (``{float32: tf32}``: fp32 dots on NVIDIA tensor cores run as
        TF32); a dtype not listed runs at its own ``peak_flops``.
      grouped_gemm_rows: the rows a grouped product (a mixture of experts' experts, one kernel) gives each
        group, rounded up to a multiple of this: its tile height (1: no rounding).
      grouped_gemm_cols: the width of that kernel's output tile; with ``compute_units`` the kernel's tiles run
        in waves over the units, a last wave partly idle (0: the roofline alone).
      grouped_gemm_min_rows: with ``compute_units``, the smallest tile height a grouped kernel runs a group of
        few rows in (the power of two that holds them, down to this; 0: always ``grouped_gemm_rows``).
      compute_units: the units a kernel's tiles are spread over (an NVIDIA GPU's SMs; 0: not modelled).
      systolic_array: the side of the matrix unit's systolic array (a TPU's MXU: 128, 256 on v6e), which
        holds a product's right-hand operand (the weight, ``k x n``): both of its dimensions are padded to a
        multiple of it, so a product narrower than the array runs at a fraction of the rate (0: not
        modelled; see :meth:`padded`).
      comm_compute_share: the share of the device's compute units an all-to-all holds while it runs beside
        compute (DeepEP's dispatch and combine kernels run on SMs of their own); compute running beside
        one slows by it (:func:`hyperjax.mpmd.lanes.replay_lanes`). A run's ``parallel.dispatcher_sms``
        sets a mixture of experts' exchange's share instead (:attr:`hyperjax.config.Run.exchange_share`);
        tensor- and context-parallel transfers keep this one.
      allocator_overhead: what the memory allocator holds beyond the live tensors, as a fraction of them
        (fragmentation, a caching allocator's free blocks, workspaces): a peak is the tensors' bytes times
        ``1 + allocator_overhead``.
      reserved_bytes: device memory the runtime takes before any tensor (the driver's context, the
        communication library's buffers, the GEMM library's workspace): what a run can use is
        ``hbm_bytes - reserved_bytes``.
      attention_kernels: the fused attention kernels measured on the device, by name (``flash2``,
        ``cudnn``): their rates as fractions of the peak (:class:`AttentionKernel`). A device with none
        runs a fused kernel at ``matmul_efficiency``.
      special_function_flops: the rate of the special-function units (the exponentials of a softmax), per
        second; with it a fused kernel's rate at another head width than it was measured at keeps each
        score's exponential and scales only its products (``None``: the measured rate at every width).
      fused_attention: the kernel a fused attention (``model.attention_kernel: flash``) runs when the
        config names none (``model.attention_impl``); one of ``attention_kernels``.
    """

    name: str
    peak_flops: Mapping[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead: float
    source: str
    matmul_precision: Mapping[str, str] = dataclasses.field(default_factory=dict)
    grouped_gemm_rows: int = 1
    grouped_gemm_cols: int = 0
    grouped_gemm_min_rows: int = 0
    compute_units: int = 0
    systolic_array: int = 0
    comm_compute_share: float = 0.0
    reserved_bytes: float = 0.0
    allocator_overhead: float = 0.05
    attention_kernels: Mapping[str, AttentionKernel] = dataclasses.field(default_factory=dict)
    fused_attention: str | None = None
    special_function_flops: float | None = None
    format_efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        require_name("device.name", self.name)
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise PresetError(
                f"device.peak_flops={self.peak_flops!r} must map each dtype to its FLOP/s, e.g. {{bfloat16: 989.0e+12}}"
            )
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES:
                raise PresetError(f"device.peak_flops.{dtype}: {dtype!r} is not one of {', '.join(DTYPES)}")
            require_positive(f"device.peak_flops.{dtype}", flops)
        numbers = ("hbm_bytes", "hbm_bandwidth", "matmul_efficiency", "memory_efficiency", "kernel_overhead")
        for key in (*numbers, "comm_compute_share", "reserved_bytes", "allocator_overhead"):
            require_number(f"device.{key}", getattr(self, key))
        require_positive("device.hbm_bytes", self.hbm_bytes)
        require_positive("device.hbm_bandwidth", self.hbm_bandwidth)
        if not 0 <= self.allocator_overhead < 1:
            raise PresetError(f"device.allocator_overhead={self.allocator_overhead} must be in [0, 1)")
        if not 0 <= self.reserved_bytes < self.hbm_bytes:
            raise PresetError(f"device.reserved_bytes={self.reserved_bytes} must be in [0, hbm_bytes={self.hbm_bytes})")
        if not 0 <= self.comm_compute_share < 1:
            raise PresetError(f"device.comm_compute_share={self.comm_compute_share} must be in [0, 1)")
        rows = self.grouped_gemm_rows
        if not is_count(rows):
            raise PresetError(f"device.grouped_gemm_rows={rows!r} must be a positive integer")
        for key in ("grouped_gemm_cols", "grouped_gemm_min_rows", "compute_units", "systolic_array"):
            value = getattr(self, key)
            if not is_count(value, least=0):
                raise PresetError(f"device.{key}={value!r} must be a non-negative integer (0: not modelled)")
        if (self.grouped_gemm_cols > 0) != (self.compute_units > 0):
            raise PresetError(
                f"device.grouped_gemm_cols={self.grouped_gemm_cols} and device.compute_units={self.compute_units}: "
                "give both (a grouped kernel's tiles run in waves over the units) or neither"
            )
        if self.systolic_array and (self.compute_units or self.attention_kernels):
            raise PresetError(
                f"device.systolic_array={self.systolic_array} pads products on a matrix unit (a TPU's MXU), but the "
                "device also gives compute_units or measured attention_kernels, whose rates already hold what the "
                "units fill; give systolic_array only to a device priced by its roofline"
            )
        if self.compute_units and rows == 1:
            raise PresetError(
                f"device.compute_units={self.compute_units} runs a grouped kernel's tiles in waves, but "
                "device.grouped_gemm_rows=1 gives it no tile height; set the kernel's tile height (128 on Hopper)"
            )
        if self.grouped_gemm_min_rows > rows:
            raise PresetError(
                f"device.grouped_gemm_min_rows={self.grouped_gemm_min_rows} exceeds device.grouped_gemm_rows={rows}: "
                "the smallest tile height a grouped kernel runs must be at most its tile height"
            )
        for key in ("matmul_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise PresetError(f"device.{key}={getattr(self, key)} must be in (0, 1]")
        if self.kernel_overhead < 0:
            raise PresetError(f"device.kernel_overhead={self.kernel_overhead} must be >= 0 seconds")
        if not isinstance(self.matmul_precision, Mapping):
            raise PresetError(
                f"device.matmul_precision={self.matmul_precision!r} must be a mapping from a compute dtype to the "
                "dtype its products run as, e.g. {float32: tf32}"
            )
        for dtype, runs_as in self.matmul_precision.items():
            for key, value in ((f"device.matmul_precision.{dtype}", runs_as), ("device.matmul_precision", dtype)):
                if not isinstance(value, str) or value not in self.peak_flops:
                    raise PresetError(
                        f"{key}: {value!r} names a dtype with no peak_flops entry; it lists "
                        f"{sorted(self.peak_flops)}. Add that dtype's FLOP/s or correct the name."
                    )
        if not isinstance(self.format_efficiency, Mapping):
            raise PresetError(f"device.format_efficiency={self.format_efficiency!r} must map a format to a fraction")
        for fmt, value in self.format_efficiency.items():
            if fmt not in self.peak_flops:
                raise PresetError(
                    f"device.format_efficiency.{fmt}: {fmt!r} has no peak_flops entry; it lists "
                    f"{sorted(self.peak_flops)}"
                )
            if not is_fraction(value):
                raise PresetError(f"device.format_efficiency.{fmt}={value!r} must be in (0, 1]")
        object.__setattr__(self, "format_efficiency", MappingProxyType(dict(self.format_efficiency)))
        if not isinstance(self.attention_kernels, Mapping):
            raise PresetError(
                f"device.attention_kernels={self.attention_kernels!r} must map a kernel's name to its rates"
            )
        kernels = {name: _kernel(name, k) for name, k in self.attention_kernels.items()}
        if self.fused_attention is not None and not isinstance(self.fused_attention, str):
            raise PresetError(
                f"device.fused_attention={self.fused_attention!r} must name a kernel (a string) or be null"
            )
        if kernels and self.fused_attention not in kernels:
            raise PresetError(
                f"device.fused_attention={self.fused_attention!r} must name one of device.attention_kernels "
                f"{sorted(kernels)}: the kernel a fused attention runs when a config names none"
            )
        if not kernels and self.fused_attention is not None:
            raise PresetError(
                f"device.fused_attention={self.fused_attention!r} names a kernel, but device.attention_kernels is empty"
            )
        object.__setattr__(self, "attention_kernels", MappingProxyType(kernels))
        if self.special_function_flops is not None:
            require_positive("device.special_function_flops", self.special_function_flops)
            for name, k in kernels.items():
                for w in k.measured():
                    for flops, rate in per_score(w):
                        self._check_exponentials(name, k, flops, rate, w.head_dim)
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "matmul_precision", MappingProxyType(dict(self.matmul_precision)))

    def __hash__(self) -> int:  # the mappings hash by their items, so a preset can key a cache
        return hash(
            (
                self.name,
                tuple(sorted(self.peak_flops.items())),
                self.hbm_bytes,
                self.hbm_bandwidth,
                self.matmul_efficiency,
                self.memory_efficiency,
                self.kernel_overhead,
                tuple(sorted(self.matmul_precision.items())),
                self.grouped_gemm_rows,
                self.grouped_gemm_cols,
                self.grouped_gemm_min_rows,
                self.compute_units,
                self.systolic_array,
                self.comm_compute_share,
                self.reserved_bytes,
                self.allocator_overhead,
                tuple(sorted(self.attention_kernels.items())),
                self.fused_attention,
                self.special_function_flops,
                tuple(sorted(self.format_efficiency.items())),
            )
        )

    @property
    def allocator_factor(self) -> float:
        """A peak's bytes per byte of live tensors: ``1 + allocator_overhead``."""
        return 1.0 + self.allocator_overhead

    @property
    def usable_bytes(self) -> float:
        """Device memory a run's tensors can use: ``hbm_bytes`` less what the runtime reserves."""
        return self.hbm_bytes - self.reserved_bytes

    def efficiency(self, fmt: str) -> float:
        """The achievable fraction of ``fmt``'s peak for large products: its own where the preset gives one."""
        return self.format_efficiency.get(fmt, self.matmul_efficiency)

    def _exp_units(self) -> float:
        """One exponential's time in units of one product FLOP's at the 16-bit peak."""
        peak = self.peak_flops.get("bfloat16", max(self.peak_flops.values()))
        return peak / self.special_function_flops

    def _check_exponentials(self, name: str, k: AttentionKernel, flops: float, rate: float, width: int) -> None:
        """A measured rate must leave room for the exponentials: beside the products (overlapped), no faster
        than they alone allow; after them, with the products at most at the peak."""
        per_score, x = flops / rate, self._exp_units()  # in product-FLOP times at the peak
        if (k.overlapped and per_score >= x) or (not k.overlapped and per_score - x >= flops):
            return
        limit = flops / x if k.overlapped else flops / (flops + x)
        raise PresetError(
            f"device.attention_kernels.{name}: a rate of {rate} at head_dim {width} is faster than its "
            f"exponentials allow at device.special_function_flops={self.special_function_flops:g} (at most "
            f"{limit:.3f} {'beside' if k.overlapped else 'after'} the products); correct the rate or the flag "
            "overlapped, or special_function_flops"
        )

    def padded(self, dim: float) -> float:
        """``dim`` as the matrix unit runs it: rounded up to a multiple of ``systolic_array`` (itself where
        that is not modelled)."""
        side = self.systolic_array
        return dim if not side else math.ceil(dim / side) * side

    def attention_rates(self, kernel: str | None, seq: float, head_dim: float | None = None) -> tuple[float, float]:
        """The forward and backward fractions of the peak fused attention ``kernel`` (``None``: the device's
        default) reaches over ``seq`` keys, with heads ``head_dim`` wide (``None``: as measured);
        ``matmul_efficiency`` both where none is measured.

        Per score, the forward multiplies ``4 head_dim`` FLOPs and the backward ``10 head_dim``. Between two
        measured widths (the kernel's own and its ``widths``), each score's time is interpolated linearly in
        the width. Beyond them, each score takes one exponential on the special-function units, whatever the
        width: from the nearest measured width, a kernel that runs them after its products keeps the
        exponential's time and scales the rest by the widths' ratio; one that overlaps them scales the whole,
        unless the exponentials then take longer than the products.

        Raises:
          PresetError: ``kernel`` is not one of the device's kernels.
        """
        if not self.attention_kernels:
            return self.matmul_efficiency, self.matmul_efficiency
        name = kernel or self.fused_attention
        if name not in self.attention_kernels:
            raise PresetError(
                f"fused attention kernel {name!r} is not one of device {self.name!r}'s attention_kernels "
                f"{sorted(self.attention_kernels)}; name one of those in model.attention_impl"
            )
        k = self.attention_kernels[name]
        ramp = seq / (seq + k.seq_half)
        if head_dim is None:
            return k.forward * ramp, k.backward * ramp
        points = k.measured()
        below = [w for w in points if w.head_dim <= head_dim]
        above = [w for w in points if w.head_dim >= head_dim]
        if below and above:  # at or between measured widths: a score's time linear in the width
            lo, hi = below[-1], above[0]
            if lo.head_dim == hi.head_dim:
                return lo.forward * ramp, lo.backward * ramp
            a = (head_dim - lo.head_dim) / (hi.head_dim - lo.head_dim)
            rates = []
            for (f0, r0), (f1, r1) in zip(per_score(lo), per_score(hi), strict=True):
                time = (1 - a) * f0 / r0 + a * f1 / r1  # in product-FLOP times at the peak
                rates.append(((1 - a) * f0 + a * f1) / time)
            return rates[0] * ramp, rates[1] * ramp
        near = below[-1] if below else above[0]
        if self.special_function_flops is None:
            return near.forward * ramp, near.backward * ramp
        x, scale = self._exp_units(), head_dim / near.head_dim
        rates = []
        for flops, rate in per_score(near):
            t = flops / rate  # the measured time per score, in product-FLOP times at the peak
            time = max(t * scale, x) if k.overlapped else (t - x) * scale + x
            rates.append(flops * scale / time)
        return rates[0] * ramp, rates[1] * ramp
