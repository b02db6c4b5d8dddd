"""horovod_zero/native.py: the C++ extension loads only under the torch it was built
against, and each way it cannot load says what happened and which command rebuilds."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from horovod_zero import native

ROOT = Path(__file__).resolve().parents[2]
PIP_REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps"


def _import_error(code, pythonpath):
    """The last line of stderr of `code` run in a fresh interpreter, which must fail."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, f"expected an ImportError; stdout:\n{res.stdout}"
    return res.stderr.strip().splitlines()[-1]


def _package_copy(tmp_path, checkout, build_info=None, core=None):
    """horovod_zero's top-level Python files in tmp_path, with a _build_info.py and a
    _core.py as given (none: absent); `checkout` adds the setup script beside it."""
    pkg = tmp_path / "horovod_zero"
    pkg.mkdir()
    for name in ("__init__.py", "native.py"):
        shutil.copy(ROOT / "horovod_zero" / name, pkg / name)
    if build_info is not None:
        (pkg / "_build_info.py").write_text(f"TORCH_VERSION = {build_info!r}\n")
    if core is not None:
        (pkg / "_core.py").write_text(core)
    if checkout:
        (tmp_path / "examples").mkdir()
        (tmp_path / "examples" / "setup.sh").write_text("")
    return tmp_path


def test_same_torch_passes_and_another_is_named_with_the_rebuild_command():
    native.check_torch_version(torch.__version__, torch.__version__)
    with pytest.raises(ImportError) as e:
        native.check_torch_version("2.11.0", "2.15.0")
    msg = str(e.value)
    assert "built against torch 2.11.0, but torch 2.15.0 is installed now" in msg, msg
    assert f"bash {ROOT}/examples/setup.sh" in msg, msg


def test_the_build_recorded_this_torch():
    from horovod_zero import _build_info
    assert _build_info.TORCH_VERSION == torch.__version__


def test_hvd_import_refuses_an_extension_built_against_another_torch():
    # The checkout's real build, with the recorded version changed in memory only: the
    # refusal comes before the module is loaded, through horovod_zero.torch's import.
    code = "import horovod_zero._build_info as b; b.TORCH_VERSION = '2.0.0'; import horovod_zero.torch"
    line = _import_error(code, ROOT)
    assert line.startswith("ImportError: horovod_zero's C++ extension was built against torch 2.0.0, "), line
    assert f"but torch {torch.__version__} is installed now" in line and "examples/setup.sh" in line, line


@pytest.mark.parametrize("checkout", [True, False], ids=["checkout", "installed"])
def test_another_torch_names_the_command_for_how_it_was_installed(tmp_path, checkout):
    path = _package_copy(tmp_path, checkout, build_info="2.0.0", core="raise AssertionError('loaded')\n")
    line = _import_error("import horovod_zero.native", path)
    assert f"built against torch 2.0.0, but torch {torch.__version__} is installed now" in line, line
    if checkout:
        assert line.endswith(f"Rebuild it against this torch: bash {path}/examples/setup.sh"), line
    else:
        assert PIP_REBUILD in line, line


def test_missing_extension_says_how_to_build_it(tmp_path):
    path = _package_copy(tmp_path, checkout=True)
    line = _import_error("import horovod_zero.native", path)
    assert line == f"ImportError: horovod_zero's C++ extension is not built. Build it: bash {path}/examples/setup.sh"


def test_extension_that_fails_to_load_shows_the_cause(tmp_path):
    core = "raise ImportError('_core.so: undefined symbol: _ZN3c104fakeEv')\n"
    path = _package_copy(tmp_path, checkout=False, build_info=torch.__version__, core=core)
    line = _import_error("import horovod_zero.native", path)
    assert "failed to load (_core.so: undefined symbol: _ZN3c104fakeEv)" in line and PIP_REBUILD in line, line

