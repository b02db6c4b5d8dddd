"""The wheel's torch requirement, a scikit-build-core metadata provider (pyproject.toml).

The extension links libtorch's C++ API, which changes from one torch release to the next,
so a wheel built against torch 2.11 requires torch==2.11.*. The build runs without
isolation, so the torch this interpreter imports is the one CMake compiles against
(cmake/HvdzTorch.cmake asks the same interpreter).
"""


def dynamic_metadata(settings, project):
    if settings.get("field") != "dependencies":
        raise ValueError(f"torch_pin provides `dependencies`, not {settings.get('field')!r}")
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "horovod_zero builds against the installed torch: install torch first, then build "
            "with `pip install --no-build-isolation .`"
        ) from e
    major, minor = torch.__version__.split(".")[:2]
    return {"dependencies": [f"torch=={major}.{minor}.*"]}
