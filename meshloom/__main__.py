import sys

from meshloom.cli import main

sys.exit(main())
