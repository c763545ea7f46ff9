"""The layout of the vLLM router record, shared by the server plug-in and the engine.

vLLM's routed-experts capture returns, per token, an integer row per MoE layer
(``routed_experts`` ``[T, L, w]``). The plug-in (:mod:`satjax.rollout.vllm_ext`) widens
that row from the k expert ids to ``w = k + k + E`` int32 columns::

    [ ids (k) | float32 bits of their gate weights (k) | float32 bits of the logits (E) ]

the gates only when recorded (always, from the vLLM engine), the logits only on request
(``rollout.record_router_logits``). Imports numpy only: vLLM loads it with the plug-in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# set in the vLLM server's environment by the engine; read when the plug-in is imported
RECORD_ENV = "SATJAX_VLLM_ROUTER_RECORD"


def parse_record(spec: str) -> tuple[str, ...]:
    """``"gates"`` / ``"gates,logits"`` / ``""`` -> the parts recorded beside the ids."""
    parts = tuple(p for p in spec.split(",") if p)
    if parts not in ((), ("gates",), ("gates", "logits")):
        raise ValueError(f"{RECORD_ENV}: '', 'gates' or 'gates,logits', got {spec!r}")
    return parts


@dataclasses.dataclass(frozen=True)
class RouterLayout:
    """One layer's packed row: ``top_k`` ids, then (``"gates"`` in ``parts``) their gate
    weights, then (``"logits"``) the ``num_experts`` router logits, float32 bits."""

    top_k: int
    num_experts: int
    parts: tuple[str, ...] = ("gates",)

    def __post_init__(self) -> None:
        parse_record(",".join(self.parts))

    @property
    def width(self) -> int:
        return self.top_k * (1 + ("gates" in self.parts)) + self.num_experts * (
            "logits" in self.parts)

    def split(self, packed: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """int ``[T, L, width]`` -> (ids int32 ``[T, L, k]``, gates float16 ``[T, L, k]``
        or None, logits float16 ``[T, L, E]`` or None)."""
        if packed.ndim != 3 or packed.shape[-1] != self.width:
            raise ValueError(f"router record of shape {packed.shape}, expected [T, L, "
                             f"{self.width}] ({self.top_k} ids, parts {self.parts})")
        rows = np.ascontiguousarray(packed, dtype=np.int32)
        k = self.top_k
        ids = rows[..., :k]

        def floats(cols: slice) -> np.ndarray:
            return np.ascontiguousarray(rows[..., cols]).view(np.float32).astype(np.float16)

        gates = floats(slice(k, 2 * k)) if "gates" in self.parts else None
        start = 2 * k if "gates" in self.parts else k
        logits = floats(slice(start, None)) if "logits" in self.parts else None
        return np.ascontiguousarray(ids), gates, logits
