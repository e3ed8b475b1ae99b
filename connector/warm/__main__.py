import sys

from connector.warm.cli import main

sys.exit(main())
