"""pytest setup for the sgm package's tests (tests/run_all.sh runs them through
the ctest `python`, which sets SGM_LIBRARY to the build's libsgm.so,
PYTHONPATH to python/, SGM_BACKEND=emu and SGM_BUILD_DIR). Run by hand:

    SGM_LIBRARY=build/release/lib/libsgm.so /usr/bin/python3 -m pytest tests/python
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
if os.path.join(SOURCE, "python") not in sys.path:
    sys.path.insert(0, os.path.join(SOURCE, "python"))
os.environ.setdefault("SGM_BACKEND", "emu")
os.environ.setdefault("SGM_VERBOSE", "0")


@pytest.fixture
def ctx(tmp_path):
    """A context on the emulated device with small budgets and a disk tier."""
    import sgm
    with sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="8MiB", shared_limit="8MiB",
                     spill_dir=str(tmp_path), verbose=0) as c:
        yield c


def child_env(**extra):
    """The environment for a child python: this one's, with the package on PYTHONPATH."""
    env = dict(os.environ)
    path = os.path.join(SOURCE, "python")
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env
