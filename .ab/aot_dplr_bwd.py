import sys; sys.path.insert(0, ".ab"); sys.path.insert(0, ".")
import aot, torch
from fastweight.kernels import dplr_bwd as m
from fastweight.kernels.common import prepare_chunks
import os; T, H = 1024, 4; K = V = int(os.environ.get("KD", 64))
bf, f32 = getattr(torch, os.environ.get("DT", "bfloat16")), torch.float32
z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)
chunks = prepare_chunks(None, 1, T, 64, torch.device("cpu"))
q = z(1, T, H, K); NC = chunks.NC
args = dict(q=q, k=q, v=z(1, T, H, V), a=q, b=q, gc=z(1, T, H, K, dt=f32), gp=z(1, T, H, K, dt=f32),
            Ai=z(1, T, H, 64, dt=f32), Aqk=z(1, T, H, 64), Aak=z(1, T, H, 64, dt=f32), w=q, u=z(1, T, H, V),
            ut=z(1, T, H, V), h=z(NC, H, K, V), dh=z(NC, H, K, V, dt=f32), du=z(1, T, H, V, dt=f32), do=z(1, T, H, V),
            wide=torch.zeros(NC, H, dtype=torch.int32))
m.dplr_bwd(**args, scale=1.0, chunks=chunks, g_dtype=f32)
aot.compile_captured()
