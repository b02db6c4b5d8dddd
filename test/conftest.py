import os
import sys

# Tests import horovod_zero from this checkout (built in place by examples/setup.sh),
# and spawned rank processes inherit this path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
