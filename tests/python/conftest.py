import os
import sys

import pytest

# Use the installed package when there is one (pip install .), else the in-tree build.
try:
    import tier  # noqa: F401
except ImportError:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "build", "python"))


@pytest.fixture
def swap_dir(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    return str(d)
