from fastweight.kernels.delta import chunk_delta_rule  # noqa: F401
from fastweight.kernels.delta import chunk_gated_delta_rule  # noqa: F401
from fastweight.kernels.delta import chunk_longhorn  # noqa: F401
