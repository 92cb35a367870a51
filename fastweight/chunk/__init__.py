from fastweight.chunk.dplr import chunk_dplr_delta_rule, chunk_rwkv7, dplr_chunk  # noqa: F401
from fastweight.chunk.parallel import attention_map, gated_delta_attention_map  # noqa: F401
