"""The wheel, as a user gets it: `pip wheel --no-build-isolation` of this checkout, installed
into a fresh virtual environment, imported from a directory outside the checkout.

The fresh environment sees torch through a .pth file naming a folder of links to torch and
its dependencies in the environment running this test (the one the wheel is built against),
not by installing torch again (gigabytes). Nothing else from that environment is visible, so
pip's check of the wheel's torch pin, the install (--no-index: nothing is downloaded) and the
import only succeed if the wheel itself is right.
"""

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import horovod_zero

ROOT = Path(__file__).resolve().parents[2]

# Run in the fresh environment, from its own directory: size 1, no launcher.
USE_WHEEL = """
import horovod_zero, horovod_zero.torch as hvd, torch
hvd.init()
out = hvd.allreduce(torch.arange(4.0), name="wheel", op=hvd.Sum)
print(horovod_zero.__version__, horovod_zero.__file__, hvd.size(), out.tolist())
hvd.shutdown()
"""

# The installed wheel's message when torch changed under it names pip, not the setup script.
FAKE_OLD_TORCH = """
import horovod_zero._build_info as info
info.TORCH_VERSION = "2.0.0"
import horovod_zero.native
"""


def _torch_closure(dest):
    """Links torch and what it requires (recursively, with the extras asked for; markers
    evaluated here) into `dest`: each distribution's top-level files and folders, its
    .dist-info included, so pip sees them installed. Returns the distributions' names."""
    dest.mkdir()
    todo, seen = [("torch", "")], set()
    while todo:
        name, extra = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = (dist.metadata["Name"].lower(), extra)
        if key in seen:
            continue
        seen.add(key)
        site = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (dest / top).exists():
                (dest / top).symlink_to(site / top)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
    return {name for name, _ in seen}


def _clean_env(**extra):
    """This process's environment less what would make the checkout or a job visible."""
    drop = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def _run(cmd, cwd, env, timeout, check=True):
    """Runs cmd in a process group of its own, so that a timeout also ends what it started
    (pip's CMake and compilers). Returns (returncode, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return proc.returncode, out, err


@pytest.mark.timeout(1500)  # a full build of the extension: minutes on two cores
def test_wheel_builds_installs_and_runs_outside_the_checkout(tmp_path):
    # HVDZ_CMAKE_ARGS must reach pip's CMake as it reaches examples/build.sh; CPU-only also
    # spares the CUDA compile (the CUDA wheel differs only in the sources CMake picks).
    build_dir = tmp_path / "build"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "wheels",
          "--config-settings", f"build-dir={build_dir}", ROOT],
         cwd=tmp_path, env=_clean_env(HVDZ_CMAKE_ARGS="-DHVDZ_CUDA=OFF"), timeout=1200)
    assert "HVDZ_CUDA:STRING=OFF" in (build_dir / "CMakeCache.txt").read_text()
    (wheel,) = (tmp_path / "wheels").glob("horovod_zero-*.whl")

    major, minor = torch.__version__.split(".")[:2]
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"horovod_zero-{horovod_zero.__version__}.dist-info/METADATA").decode()
        names = z.namelist()
    assert f"Requires-Dist: torch=={major}.{minor}.*" in metadata.splitlines(), metadata[:600]
    assert any(re.fullmatch(r"horovod_zero/_core\..*\.so", n) for n in names), names
    assert "horovod_zero/_build_info.py" in names and "horovod_zero/native.py" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, _clean_env(), 300)
    py = str(venv / "bin" / "python")
    _, site, _ = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, _clean_env(), 60)
    assert "torch" in _torch_closure(tmp_path / "torch_site")
    (Path(site.strip()) / "torch_from_test.pth").write_text(str(tmp_path / "torch_site") + "\n")
    _run([py, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", wheel], tmp_path, _clean_env(), 300)

    out = _run([py, "-c", USE_WHEEL], tmp_path, _clean_env(), 300)[1].split()
    version, file, size, result = out[0], out[1], out[2], " ".join(out[3:])
    assert version == horovod_zero.__version__
    assert Path(file).is_relative_to(venv), f"horovod_zero imported from {file}, not the wheel in {venv}"
    assert (size, result) == ("1", "[0.0, 1.0, 2.0, 3.0]")

    rc, _, err = _run([py, "-c", FAKE_OLD_TORCH], tmp_path, _clean_env(), 300, check=False)
    assert rc != 0
    assert f"built against torch 2.0.0, but torch {torch.__version__} is installed now" in err, err
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in err, err
