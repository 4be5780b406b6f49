"""Parameter tables computed once (``nnh-precompute``), looked up by sample id and epoch."""

from nnh_data.precompute.table import (
    PrecomputedParams,
    PrecomputeSpec,
    load_precomputed_params,
    verify_precomputed_params,
    write_precomputed_params,
)

__all__ = [
    "PrecomputeSpec",
    "PrecomputedParams",
    "load_precomputed_params",
    "verify_precomputed_params",
    "write_precomputed_params",
]
