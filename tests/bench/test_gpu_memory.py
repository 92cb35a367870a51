"""The peak-memory attribution of ``fastweight.bench.gpu_memory`` on a made-up allocator trace
(the bench itself needs a GPU)."""

from fastweight.bench.gpu_memory import peak_by_site


def _frames(line, name="f"):
    return [{"filename": "/x/torch/y.py", "line": 1, "name": "g"},
            {"filename": "/repo/fastweight/kernels/k.py", "line": line, "name": name}]


def test_peak_by_site_replays_allocs_and_frees():
    trace = [
        dict(action="alloc", addr=1, size=100, frames=_frames(10)),
        dict(action="alloc", addr=2, size=50, frames=_frames(20)),
        dict(action="free_requested", addr=1, size=100),
        dict(action="free_completed", addr=1, size=100),   # counted once, at the request
        dict(action="alloc", addr=3, size=70, frames=_frames(20)),
        dict(action="alloc", addr=4, size=10, frames=_frames(30)),   # peak: 50 + 70 + 10 = 130 < 150
        dict(action="segment_alloc", addr=9, size=10 ** 6),
    ]
    peak, sites = peak_by_site(trace)
    assert peak == 150
    assert sites == {"kernels/k.py:10 f": 100, "kernels/k.py:20 f": 50}


def test_peak_by_site_charges_the_innermost_fastweight_frame():
    frames = [{"filename": "/repo/fastweight/kernels/common.py", "line": 74, "name": "alloc"},
              {"filename": "/repo/fastweight/kernels/state.py", "line": 381, "name": "state_fwd"}]
    _, sites = peak_by_site([dict(action="alloc", addr=1, size=8, frames=frames),
                             dict(action="alloc", addr=2, size=8, frames=[])])
    assert sites == {"kernels/common.py:74 alloc": 8, "?": 8}
