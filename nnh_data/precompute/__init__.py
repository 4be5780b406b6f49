"""Parameter tables computed once (``nnh-precompute``), looked up by sample id and epoch."""

from nnh_data.precompute.read import PrecomputedParams, load_precomputed_params
from nnh_data.precompute.spec import MANIFEST_NAME, ROWS_PER_GROUP, PrecomputeSpec
from nnh_data.precompute.verify import verify_precomputed_params
from nnh_data.precompute.write import finalize_precomputed_params, write_precomputed_params

__all__ = [
    "MANIFEST_NAME",
    "ROWS_PER_GROUP",
    "PrecomputeSpec",
    "PrecomputedParams",
    "finalize_precomputed_params",
    "load_precomputed_params",
    "verify_precomputed_params",
    "write_precomputed_params",
]
