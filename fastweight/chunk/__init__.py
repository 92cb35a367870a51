"""Pure PyTorch chunkwise algorithms (the readable spec of the kernels; the fast path on CPU).

``chunk_<op>`` follows the dispatch signature (``fastweight.dispatch``). decay.py: the decay
family; delta.py: the delta family through the UT transform; solve_tril.py: the unit-lower solve;
common.py: the shared stages (varlen layout, decayed intra-chunk scores, state passing).
"""
from fastweight.chunk.decay import (chunk_gla, chunk_hgrn2, chunk_linear_attn, chunk_retention,  # noqa: F401
                                    chunk_rwkv6, chunk_simple_gla, decay_chunk)
from fastweight.chunk.delta import (chunk_comba, chunk_delta_rule, chunk_gated_delta_rule, chunk_kda,  # noqa: F401
                                    chunk_longhorn, delta_chunk)
from fastweight.chunk.solve_tril import solve_unit_lower  # noqa: F401
from fastweight.chunk.dplr import chunk_dplr_delta_rule, chunk_rwkv7, dplr_chunk  # noqa: F401
from fastweight.chunk.parallel import attention_map, gated_delta_attention_map  # noqa: F401
