"""``python -m connector.proxy``: the proxy server."""

import sys

from connector.proxy.server import main

sys.exit(main())
