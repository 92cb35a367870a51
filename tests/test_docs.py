"""Every Python snippet of README.md and docs/models.md runs as written (in order, one namespace per file)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
FILES = ("README.md", os.path.join("docs", "models.md"))


def snippets(path):
    return re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, path)).read(), flags=re.S)


@pytest.mark.parametrize("path", FILES)
def test_snippets_run(path):
    blocks = snippets(path)
    assert blocks, f"no python snippet in {path}"
    namespace = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path} snippet {i + 1}", "exec"), namespace)  # noqa: S102  (our own docs)
