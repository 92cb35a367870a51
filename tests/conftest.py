import os

import pytest
import torch

from fastweight import testing

# Triton kernels run under the interpreter on a machine without a GPU (fp32/fp16 only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    testing.fresh_seeds.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test reports the fresh seeds its ``generator()`` calls drew, to reproduce it."""
    report = (yield).get_result()
    if report.failed and testing.fresh_seeds:
        report.sections.append(("fastweight.testing.generator seeds", ", ".join(map(str, testing.fresh_seeds))))
