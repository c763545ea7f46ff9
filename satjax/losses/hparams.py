"""Hyperparameters of every objective: the one place their defaults and ranges are written.

One frozen dataclass per objective, built from shared parts: :class:`HParams` (the
rollout/trainer importance-sampling correction every objective has), :class:`ClipHParams`
(ratio clip radii, the SAT paper's (0.2, 0.2) for every clip objective) with its
sequence-level (GSPO family) and token-level (PPO/GRPO: the dual clip) branches,
:class:`SatKernelHParams` (the SAT contraction kernel) and :class:`DppoHParams` (DPPO's
divergence thresholds instead of a ratio clip). Constructing one validates it, so an
instance is always in range::

    >>> from satjax.losses import SatGspoHParams
    >>> SatGspoHParams(kernel="smooth", lam=0.5).lam
    0.5
    >>> SatGspoHParams(kernel="smooth", lam=1.5)
    Traceback (most recent call last):
    ...
    ValueError: lam: must be <= 1.0, got 1.5
    >>> SatGspoHParams(lam=0.5)  # the paper's kernel has no strength parameter
    Traceback (most recent call last):
    ...
    ValueError: lam: applies to kernel 'smooth' or 'gauss', not 'paper'; got 0.5

The loss functions take their keyword defaults from these classes and validate their
hyperparameter arguments with :func:`check_hparams` (the same ranges, the same messages).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import numpy as np

from satjax.losses._checks import check_choice, check_range, is_concrete

Kernel = Literal["paper", "smooth", "gauss"]
Scale = Literal["rms", "mad"]
Proxy = Literal["broadcast", "sequence", "token"]
Scope = Literal["microbatch", "batch"]
ISLevel = Literal["token", "sequence"]
ISCorrection = Literal["tis", "mis"] | None

KERNELS: tuple[str, ...] = get_args(Kernel)
SCALES: tuple[str, ...] = get_args(Scale)
PROXIES: tuple[str, ...] = get_args(Proxy)
SCOPES: tuple[str, ...] = get_args(Scope)
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)
IS_CORRECTIONS: tuple[str | None, ...] = (None, *get_args(get_args(ISCorrection)[0]))

# Choice-valued hyperparameters, by argument name (static under jit: they change the program).
CHOICES: dict[str, tuple[Any, ...]] = {
    "kernel": KERNELS, "scale": SCALES, "proxy": PROXIES, "scope": SCOPES, "level": IS_LEVELS,
    "is_level": IS_LEVELS, "is_correction": IS_CORRECTIONS,
}
# Numbers that are static under jit too: the quantile level sets the gate's rank with exact
# integer arithmetic (``masked_quantile``'s "inverted_cdf"), which needs a Python number.
STATIC_NUMBERS: frozenset[str] = frozenset({"quantile"})
_IS_THRESHOLD = {"low": 0.0, "low_open": True}
# Ranges of the numeric hyperparameters, by argument name (traced under jit).
RANGES: dict[str, dict[str, Any]] = {
    "eps_low": {"low": 0.0},
    "eps_high": {"low": 0.0},
    "lam": {"low": 0.0, "high": 1.0},
    "c": {"low": 0.0},
    "w": {"low": 0.0, "low_open": True},
    "quantile": {"low": 0.0, "high": 1.0},
    "c_min": {"low": 0.0, "high": 1.0},
    "threshold": _IS_THRESHOLD,  # tis_weights / mis_mask spell is_threshold this way
    "is_threshold": _IS_THRESHOLD,
    "low_threshold": {"low": 0.0},
    "is_threshold_low": {"low": 0.0},
    "clip_ratio_c": {"low": 1.0, "low_open": True},  # verl's dual clip: must exceed 1
    "eps": {"low": 0.0},
    "ddof": {"low": 0.0},
    "delta_low": {"low": 0.0},
    "delta_high": {"low": 0.0},
    "ratio_cap": {"low": 0.0, "low_open": True},
}
# Numeric hyperparameters whose ``None`` means "off".
OPTIONAL: frozenset[str] = frozenset({"low_threshold", "is_threshold_low", "clip_ratio_c"})
INTEGERS: frozenset[str] = frozenset({"ddof"})  # used in Python arithmetic, never traced
FLAGS: frozenset[str] = frozenset({"normalize_std"})


def check_hparams(**values: Any) -> None:
    """Validate hyperparameters by name; numbers are skipped when traced (see ``_checks``)."""
    for name, value in values.items():
        if value is None and name in OPTIONAL:
            continue
        if name in FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be a bool, got {value!r}")
        elif name in INTEGERS and not isinstance(value, int | np.integer):
            raise ValueError(f"{name}: must be an int, got {value!r}")
        elif name in CHOICES:
            check_choice(name, value, CHOICES[name])
        else:
            check_range(name, value, **RANGES[name])


class _Validated:
    """Checks every field at construction, so an instance is always in range (including
    fields the other settings leave unused, e.g. ``is_threshold`` without a correction)."""

    if TYPE_CHECKING:  # the subclasses are dataclasses (kept out of their get_type_hints)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        check_hparams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class HParams(_Validated):
    """What every objective has: the IS correction.

    ``is_correction`` None | "tis" (:func:`~satjax.losses.tis_weights`) | "mis"
    (:func:`~satjax.losses.mis_mask`) with ``is_threshold`` and ``is_level``;
    ``is_threshold_low`` is MIS's lower bound (None: no lower bound; MIS only).
    """

    is_correction: ISCorrection = None
    is_threshold: float = 2.0
    is_threshold_low: float | None = None
    is_level: ISLevel = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        low = self.is_threshold_low
        if low is not None and self.is_correction != "mis":
            raise ValueError(f"is_threshold_low: must be None unless is_correction='mis' "
                             f"(TIS truncates from above only), got {low!r}")
        if low is not None and low > self.is_threshold:
            raise ValueError(f"is_threshold_low: must be <= is_threshold="
                             f"{self.is_threshold!r}, got {low!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClipHParams(HParams):
    """The ratio clip interval ``[1 - eps_low, 1 + eps_high]`` (every objective but DPPO).

    The defaults are the SAT paper's radii, (0.2, 0.2) for GRPO, GSPO and their SAT
    variants alike (the authors' project page, "Setup"). Elsewhere: DAPO's clip-higher
    (0.2, 0.28) for token ratios; the GSPO paper's (3e-4, 4e-4) for its sequence ratio at
    ~1000-token responses (docs/objectives.md).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceClipHParams(ClipHParams):
    """The GSPO family: the clipped ratio is a per-sequence geometric mean."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenClipHParams(ClipHParams):
    """Token-level ratios, and the dual clip.

    ``clip_ratio_c`` (verl's name; None = off, else > 1): for ``A < 0`` the token loss is
    capped at ``clip_ratio_c * |A|`` (dual-clip PPO, Ye et al. 2020), so one token with a
    huge ratio cannot dominate a negative-advantage update.
    """

    clip_ratio_c: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SatKernelHParams(_Validated):
    """SAT contraction kernel (:func:`~satjax.losses.sat_interval` documents each field).

    ``kernel="paper"`` is the authors' rule and has one parameter, ``quantile``; the other
    kernels are this project's (``smooth``: ``quantile``, ``lam``, ``c_min``; ``gauss``:
    ``lam``, ``c``, ``w``, ``scale``). Setting a parameter the kernel does not read is an
    error, so a sweep cannot silently vary nothing. ``scope``: the statistics (the gate
    ``q``) over each gradient-accumulation micro-batch ("microbatch", the paper's) or over
    the whole batch of an optimizer step ("batch").
    """

    kernel: Kernel = "paper"
    quantile: float = 0.9
    lam: float = 1.0
    c_min: float = 0.1
    c: float = 1.0
    w: float = 1.0
    scale: Scale = "rms"
    scope: Scope = "microbatch"

    # The parameters each kernel reads (the others must keep their defaults).
    KERNEL_PARAMS: ClassVar[dict[str, tuple[str, ...]]] = {
        "paper": ("quantile",), "smooth": ("quantile", "lam", "c_min"),
        "gauss": ("lam", "c", "w", "scale")}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kernel_params(self.kernel, {
            name: getattr(self, name) for names in self.KERNEL_PARAMS.values()
            for name in names})


def check_kernel_params(kernel: str, values: dict[str, Any]) -> None:
    """Raises ValueError naming the first of ``values`` that ``kernel`` does not read and
    that differs from its default (:class:`SatKernelHParams`); traced values are skipped
    (the loss functions check their arguments before tracing)."""
    check_choice("kernel", kernel, KERNELS)
    used = SatKernelHParams.KERNEL_PARAMS[kernel]
    for name, value in values.items():
        default = SatKernelHParams.__dataclass_fields__[name].default
        if name not in used and is_concrete(value) and value != default:
            users = " or ".join(repr(k) for k, ps in SatKernelHParams.KERNEL_PARAMS.items()
                                if name in ps)
            raise ValueError(f"{name}: applies to kernel {users}, not {kernel!r}; "
                             f"got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GspoHParams(SequenceClipHParams):
    """:func:`~satjax.losses.gspo_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GspoTokenHParams(SequenceClipHParams):
    """:func:`~satjax.losses.gspo_token_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SatGspoHParams(SatKernelHParams, SequenceClipHParams):
    """:func:`~satjax.losses.sat_gspo_loss` (the project's default objective)."""

    proxy: Proxy = "broadcast"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoHParams(TokenClipHParams):
    """:func:`~satjax.losses.grpo_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpoClipHParams(TokenClipHParams):
    """:func:`~satjax.losses.ppo_clip_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SatPpoHParams(SatKernelHParams, TokenClipHParams):
    """:func:`~satjax.losses.sat_ppo_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SatGrpoHParams(SatKernelHParams, TokenClipHParams):
    """:func:`~satjax.losses.sat_grpo_loss`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DppoHParams(HParams):
    """DPPO (:func:`~satjax.losses.dppo_tv_loss`, :func:`~satjax.losses.dppo_kl_loss`):
    a token's gradient is dropped when the divergence between the current and the reference
    probability of the sampled token leaves ``delta_low`` (``A < 0``) or ``delta_high``
    (``A > 0``); kept tokens are weighted by ``min(r, ratio_cap)`` (no gradient through it).
    ``ratio_cap`` is 1e4 in the paper's recipe, i.e. practically no truncation.
    """

    ratio_cap: float = 1e4


@dataclasses.dataclass(frozen=True, kw_only=True)
class DppoTvHParams(DppoHParams):
    """DPPO-Binary-TV: thresholds on ``p - q`` (the DPPO paper's and verl's default 0.15;
    the SAT paper's grid runs 1e-3)."""

    delta_low: float = 0.15
    delta_high: float = 0.15


@dataclasses.dataclass(frozen=True, kw_only=True)
class DppoTvClipHParams(TokenClipHParams):
    """:func:`~satjax.losses.dppo_tv_clip_loss`, DPPO-TV as the SAT page's grid runs it:
    GRPO's clip radii and DPPO-TV's thresholds on ``p - q``, at the grid's 1e-3."""

    delta_low: float = 1e-3
    delta_high: float = 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
class DppoKlHParams(DppoHParams):
    """DPPO-Binary-KL: thresholds on the binary KL ``KL(Bern(q) || Bern(p))`` (default 0.05)."""

    delta_low: float = 0.05
    delta_high: float = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupAdvantageHParams(_Validated):
    """:func:`~satjax.losses.group_advantages`: ``A = (r - mean) / (std + eps)`` per group.

    ``ddof=1`` is the sample std, as verl, TRL and slime compute it (``ddof=0``, the
    population std, gives larger advantages for small groups: x1.41 at G=2).
    """

    normalize_std: bool = True
    ddof: int = 1
    eps: float = 1e-6


SAT_DEFAULTS = SatKernelHParams()  # what the SAT functions' keyword defaults read
