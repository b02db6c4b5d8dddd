"""Builds horovod_zero's C++ core and extension with CMake.

Install into an environment that already has torch, without build isolation (the
build compiles against that torch):  pip install --no-build-isolation -e .
CMake options pass through HVDZ_CMAKE_ARGS, e.g. HVDZ_CMAKE_ARGS="-DHVDZ_CUDA=OFF".
"""

import os
import shlex
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def _nccl_hint():
    try:
        import nvidia.nccl  # the NCCL wheel torch loads
        return ["-DNCCL_PYTHON_ROOT=" + list(nvidia.nccl.__path__)[0]]
    except ImportError:
        return []


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.environ.get("HVDZ_BUILD_DIR", os.path.join(ROOT, "build", "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        cfg = [
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            "-DCMAKE_PREFIX_PATH=" + torch.utils.cmake_prefix_path,
            "-DPython3_EXECUTABLE=" + sys.executable,
            "-DHVDZ_PACKAGE_DIR=" + out_dir,
        ] + _nccl_hint() + shlex.split(os.environ.get("HVDZ_CMAKE_ARGS", ""))
        subprocess.check_call(cfg)
        jobs = os.environ.get("HVDZ_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs])


setup(
    name="horovod_zero",
    version="0.1.0",
    description="Horovod-style collectives and ZeRO sharded data parallelism for PyTorch",
    packages=find_packages(include=["horovod_zero", "horovod_zero.*"]),
    ext_modules=[CMakeExtension("horovod_zero._core")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    zip_safe=False,
)
