"""The multi-GPU context-parallel benchmark's CPU smoke run: gloo, 2 processes, a toy shape."""

import json
import os
import socket

import torch.multiprocessing as mp

from fastweight.bench import gpu_context_parallel


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    gpu_context_parallel.main(["--device", "cpu", "--ops", "gated_delta_rule,simple_gla", "--T", "96", "--H", "2",
                               "--K", "16", "--out", out])


def test_cpu_smoke(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    rows = json.loads((tmp_path / "context_parallel.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["gated_delta_rule", "simple_gla"]
    for r in rows:
        # float32 on the CPU: the split stream against the whole one
        assert max(r["errors"].values()) < 1e-4, r["errors"]
        assert {"o", "final_state", "dq", "dk", "dv", "dg"} <= set(r["errors"]), r["errors"]
        assert r["cp_fwd_bwd_ms"] > 0 and r["gather_bytes_per_rank"] > 0
    # the delta rule's P is dense (K^2 per value head), the scalar decay's diagonal (K)
    assert rows[0]["gather_bytes_per_rank"] == 2 * 16 * (16 + 16) * 4
    assert rows[1]["gather_bytes_per_rank"] == 2 * 16 * (16 + 1) * 4
