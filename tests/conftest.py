import os

import pytest
import torch

from fastweight import testing

# Triton kernels run under the interpreter on a machine without a GPU (fp32/fp16 only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One share of the cores per pytest-xdist worker (torch's default, every core in each worker,
# oversubscribes: on 2 cores with 2 workers the suite ran ~4x slower); FASTWEIGHT_TEST_THREADS overrides.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("FASTWEIGHT_TEST_THREADS", 0)) or max(1, (os.cpu_count() or 1) // _workers))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    testing.fresh_seeds.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test reports the fresh seeds its ``generator()`` calls drew, to reproduce it."""
    report = (yield).get_result()
    if report.failed and testing.fresh_seeds:
        report.sections.append(("fastweight.testing.generator seeds", ", ".join(map(str, testing.fresh_seeds))))
