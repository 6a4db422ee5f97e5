import sys

from tierserve.cli import main

sys.exit(main())
