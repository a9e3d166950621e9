"""The README's example runs and does what its comments say."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    stats = scope["od"].comm_stats(scope["opt_state"])
    assert stats.by_kind == {"all_reduce[bfloat16]": (100, 800)}
    np.testing.assert_allclose(np.asarray(scope["params"]["w"][0]).ravel(), [0, 1, 2, 3], atol=0.05)
