"""cmake --install puts the package where Debian's python3 finds it: under a
prefix on the interpreter's path (/usr/local) in the folder python3 searches,
and under any other prefix in <prefix>/lib/python3.X/site-packages (with
PYTHONPATH); the installed package loads the libsgm.so installed with it."""
import os
import subprocess
import sys

import pytest

BUILD = os.environ.get("SGM_BUILD_DIR")
CMAKE = os.environ.get("SGM_CMAKE", "cmake")
pytestmark = pytest.mark.skipif(not BUILD, reason="SGM_BUILD_DIR names no build tree "
                                "(the ctest `python` sets it)")


def install(prefix, destdir=None):
    env = dict(os.environ)
    if destdir:
        env["DESTDIR"] = str(destdir)
    r = subprocess.run([CMAKE, "--install", BUILD, "--prefix", prefix], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SGM_LIBRARY", "LD_LIBRARY_PATH")}
    env.update(extra)
    return env


def test_install_into_usr_local_lands_on_python3s_path(tmp_path):
    """Invariant: with prefix /usr/local (the default), the package lands in a
    folder that /usr/bin/python3 searches without PYTHONPATH."""
    install("/usr/local", destdir=tmp_path)
    found = [os.path.dirname(os.path.relpath(root, tmp_path))
             for root, dirs, files in os.walk(tmp_path) if root.endswith(os.sep + "sgm")
             and "__init__.py" in files]
    assert len(found) == 1, found
    site = "/" + found[0]
    r = subprocess.run([sys.executable, "-c", "import sys; print('\\n'.join(sys.path))"],
                       env=clean_env(), capture_output=True, text=True)
    assert site in r.stdout.split("\n"), f"{site} is not on {sys.executable}'s path"
    installed = tmp_path / site.lstrip("/") / "sgm"
    assert (installed / "_install.py").exists() and (installed / "plot.py").exists()
    assert not (installed / "__pycache__").exists()


def test_installed_package_imports_and_loads_its_own_library(tmp_path):
    """Invariant: under a temporary prefix, python3 -c "import sgm" (with the
    PYTHONPATH the install names) imports the installed copy, which loads the
    libsgm.so of that prefix, even after the tree moved."""
    out = install(str(tmp_path / "p"))
    assert "PYTHONPATH=" in out
    os.rename(tmp_path / "p", tmp_path / "moved")
    site = [os.path.join(root) for root, dirs, files in os.walk(tmp_path / "moved")
            if root.endswith("-packages") and "sgm" in dirs]
    assert len(site) == 1, site
    code = ("import sgm; c = sgm.Context(backend='emu', emu_vram='64MiB'); "
            "print(sgm.__file__); print(sgm.library_path()); print(c.backend)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                       env=clean_env(PYTHONPATH=site[0], SGM_VERBOSE="0"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    file, lib, backend = r.stdout.split()
    moved = str(tmp_path / "moved") + os.sep
    assert file.startswith(moved) and lib.startswith(moved), r.stdout
    assert backend == "emu"
