import os
import sys

import pytest

# Use the installed package when there is one (pip install .), else the in-tree build.
try:
    import tier  # noqa: F401
except ImportError:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "build", "python"))


def pytest_configure(config):
    # The quick tier for a developer's inner loop: `pytest -m "not slow"` leaves out the multi-process
    # runs and the crash campaigns (100 s instead of 576 s on 2 cores). CI runs everything.
    config.addinivalue_line("markers", "slow: spawns processes or runs a crash campaign; left out by -m 'not slow'")


@pytest.fixture
def swap_dir(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    return str(d)
