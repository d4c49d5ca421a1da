import sys

from meshloom.cli.train import main

sys.exit(main())
