"""python -m horovod_zero.horovod_compat install|uninstall: writes or removes the .pth file
that makes `import horovod.torch` horovod_zero's in this environment (see __init__.py)."""

import os
import sys
import sysconfig

from horovod_zero.horovod_compat import PTH_LINE, PTH_NAME


def main(argv) -> int:
    path = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    if argv == ["install"]:
        with open(path, "w") as f:
            f.write(PTH_LINE)
        print(f"{path}: `import horovod.torch` is horovod_zero's in {sys.prefix}")
    elif argv == ["uninstall"]:
        if os.path.exists(path):
            os.remove(path)
        print(f"{path} removed: `import horovod.torch` is Horovod's own in {sys.prefix}")
    else:
        print("usage: python -m horovod_zero.horovod_compat install|uninstall", file=sys.stderr)
        return 2
    return 0


sys.exit(main(sys.argv[1:]))
