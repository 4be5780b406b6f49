"""Parameter tables computed once (``nnh-precompute``), looked up by sample id and epoch."""

from nnh_data.precompute.read import PrecomputedParams, load_precomputed_params
from nnh_data.precompute.spec import PrecomputeSpec
from nnh_data.precompute.verify import verify_precomputed_params
from nnh_data.precompute.write import write_precomputed_params

__all__ = [
    "PrecomputeSpec",
    "PrecomputedParams",
    "load_precomputed_params",
    "verify_precomputed_params",
    "write_precomputed_params",
]
