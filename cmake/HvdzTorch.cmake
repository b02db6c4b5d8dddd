# The torch the extension builds against is the one the build's Python imports
# (examples/setup.sh passes its environment's python; pip builds pass their own). Ask
# it for torch's CMake config, torch's version (written next to the extension, see
# python/CMakeLists.txt, so that horovod_zero/native.py can tell when torch changed),
# and the nvidia-nccl wheel torch loads, so that one libnccl.so.2 serves both
# (FindNCCL.cmake). Sets HVDZ_TORCH_VERSION.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c [=[
import torch
try:
    import nvidia.nccl
    nccl = list(nvidia.nccl.__path__)[0]
except ImportError:
    nccl = ""
print(";".join([torch.utils.cmake_prefix_path, torch.__version__, nccl]), end="")
]=]
  RESULT_VARIABLE _hvdz_rc OUTPUT_VARIABLE _hvdz_torch ERROR_VARIABLE _hvdz_err)
if(NOT _hvdz_rc EQUAL 0)
  message(FATAL_ERROR "${Python3_EXECUTABLE} cannot import torch, which horovod_zero builds against:\n"
                      "${_hvdz_err}Install torch in that environment (examples/setup.sh does), or pass "
                      "-DPython3_EXECUTABLE=<a python that has torch>.")
endif()
list(GET _hvdz_torch 0 _hvdz_torch_prefix)
list(GET _hvdz_torch 1 HVDZ_TORCH_VERSION)
list(GET _hvdz_torch 2 _hvdz_nccl)
list(APPEND CMAKE_PREFIX_PATH "${_hvdz_torch_prefix}")
if(NOT NCCL_PYTHON_ROOT AND _hvdz_nccl)
  set(NCCL_PYTHON_ROOT "${_hvdz_nccl}")
endif()
message(STATUS "horovod_zero: torch ${HVDZ_TORCH_VERSION} (${Python3_EXECUTABLE})")
