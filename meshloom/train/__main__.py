import sys

from meshloom.train.main import main

sys.exit(main())
