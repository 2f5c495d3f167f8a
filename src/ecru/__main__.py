import sys

from ecru.cli import main

sys.exit(main())
