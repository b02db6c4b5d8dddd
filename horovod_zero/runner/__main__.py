import sys

from horovod_zero.runner.launch import main

sys.exit(main())
