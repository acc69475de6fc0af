import sys

from closedloop.cli import main

sys.exit(main())
