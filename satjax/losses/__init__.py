"""Pure-jnp policy-gradient losses, SAT kernels, IS corrections and advantages.

One module per family, everything re-exported here (``satjax.losses.X``):

* :mod:`~satjax.losses.policy_gradient`: ``ppo_clip_loss``, ``grpo_loss``, ``gspo_loss``,
  ``gspo_token_loss``, ``sat_ppo_loss``, ``sat_grpo_loss``, ``sat_gspo_loss``,
  ``dppo_tv_loss``, ``dppo_tv_clip_loss``, ``dppo_kl_loss``, ``clipped_surrogate``,
  ``AUX_KEYS``;
* :mod:`~satjax.losses.sat`: ``sat_interval`` (the authors' kernel; our smooth and gauss
  variants);
* :mod:`~satjax.losses.corrections`: ``tis_weights``, ``mis_mask``;
* :mod:`~satjax.losses.advantages`: ``group_advantages``;
* :mod:`~satjax.losses.regularizers`: ``kl_penalty``, ``sequence_kl_penalty``,
  ``reference_kl`` (k1/k2/k3/low_var_kl KL to a reference policy, per token or sequence);
* :mod:`~satjax.losses.quantile`: ``masked_quantile``, ``masked_mean``;
* :mod:`~satjax.losses.hparams`: one frozen dataclass of defaults and ranges per
  objective (``SatGspoHParams``, ...) and for ``group_advantages``
  (``GroupAdvantageHParams``), the choice tuples ``KERNELS``, ``SCALES``, ``PROXIES``,
  ``SCOPES``, ``IS_LEVELS``;
* :mod:`~satjax.losses.registry`: ``OBJECTIVES``, filled by ``@register(name, HParams)``
  on each loss where it is defined.

:mod:`satjax.objectives` wraps the registered losses as named objectives
``fn(logprobs, batch)``.
"""

from satjax.losses.advantages import group_advantages
from satjax.losses.corrections import mis_mask, tis_weights
from satjax.losses.hparams import (
    IS_CORRECTIONS,
    IS_LEVELS,
    KERNELS,
    PROXIES,
    SCALES,
    SCOPES,
    ClipHParams,
    DppoHParams,
    DppoKlHParams,
    DppoTvClipHParams,
    DppoTvHParams,
    GroupAdvantageHParams,
    GrpoHParams,
    GspoHParams,
    GspoTokenHParams,
    HParams,
    PpoClipHParams,
    SatGrpoHParams,
    SatGspoHParams,
    SatKernelHParams,
    SatPpoHParams,
    SequenceClipHParams,
    TokenClipHParams,
)
from satjax.losses.policy_gradient import (
    AUX_KEYS,
    clipped_surrogate,
    dppo_kl_loss,
    dppo_tv_clip_loss,
    dppo_tv_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    sat_grpo_loss,
    sat_gspo_loss,
    sat_ppo_loss,
)
from satjax.losses.quantile import masked_mean, masked_quantile
from satjax.losses.registry import OBJECTIVES
from satjax.losses.regularizers import (
    KL_ESTIMATORS,
    KL_LEVELS,
    kl_penalty,
    reference_kl,
    sequence_kl_penalty,
)
from satjax.losses.sat import sat_interval

__all__ = [
    "AUX_KEYS", "IS_CORRECTIONS", "KL_ESTIMATORS", "KL_LEVELS", "IS_LEVELS", "KERNELS",
    "OBJECTIVES", "PROXIES", "SCALES", "SCOPES",
    "ClipHParams", "DppoHParams", "DppoKlHParams", "DppoTvClipHParams", "DppoTvHParams",
    "GroupAdvantageHParams",
    "GrpoHParams", "GspoHParams", "GspoTokenHParams", "HParams", "PpoClipHParams",
    "SatGrpoHParams", "SatGspoHParams", "SatKernelHParams", "SatPpoHParams", "SequenceClipHParams",
    "TokenClipHParams",
    "clipped_surrogate", "dppo_kl_loss", "dppo_tv_clip_loss", "dppo_tv_loss",
    "group_advantages", "grpo_loss",
    "gspo_loss", "gspo_token_loss", "kl_penalty", "masked_mean", "masked_quantile", "mis_mask",
    "ppo_clip_loss", "reference_kl", "sat_grpo_loss", "sat_gspo_loss", "sat_interval",
    "sat_ppo_loss", "sequence_kl_penalty", "tis_weights",
]
