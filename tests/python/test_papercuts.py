"""Issue 28 item 14, the papercuts a lab admin meets on day one: print(tier)
says Tier.VRAM, an error names its call once, the loaded library's version
is asked at run time, the examples say PyTorch/CuPy is missing rather than
"no GPU", and sgm-demo --plot names the import that is missing."""
import importlib.util
import os
import subprocess
import sys

import pytest

import sgm
from conftest import HERE, SOURCE, child_env


def test_tier_prints_its_name():
    assert str(sgm.Tier.VRAM) == "Tier.VRAM"
    assert f"{sgm.Tier.SHARED}" == "Tier.SHARED"
    assert sgm.Tier.DISK == 2  # still an int where one is wanted


def test_error_names_its_call_once():
    e = sgm.InvalidError("sgm_free: the pointer is not one of this context's", call="sgm_free")
    assert str(e).count("sgm_free:") == 1, str(e)
    e = sgm.InvalidError("the pointer is not one of this context's", call="sgm_free")
    assert str(e).startswith("sgm_free: the pointer"), str(e)


def test_version_is_the_loaded_library():
    v = sgm.version()
    assert v.count(".") == 2 and all(p.isdigit() for p in v.split("."))
    assert v == sgm.__version__  # the package and the library of one build


@pytest.mark.parametrize("example,module,says", [("pytorch_allocator.py", "torch", "PyTorch is not installed"),
                                                  ("cupy_allocator.py", "cupy", "CuPy is not installed")])
def test_examples_say_the_framework_is_missing(example, module, says):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here: the missing-framework message cannot show")
    r = subprocess.run([sys.executable, os.path.join(SOURCE, "examples", example)], env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert says in r.stdout and "no GPU" not in r.stdout, r.stdout


def test_demo_plot_names_the_missing_import(tmp_path):
    build = os.environ.get("SGM_BUILD_DIR")
    demo = os.path.join(build, "examples", "sgm-demo") if build else None
    if not demo or not os.path.exists(demo):
        pytest.skip("SGM_BUILD_DIR has no examples/sgm-demo (run through ctest)")
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = child_env(PYTHONPATH=f"{fake}:{os.path.join(SOURCE, 'python')}", SGM_PYTHON=sys.executable)
    r = subprocess.run([demo, "--plot", str(tmp_path / "out.png")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot import matplotlib" in r.stderr, r.stderr
    assert "sgm package" not in r.stderr, r.stderr
