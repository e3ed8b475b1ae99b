"""The project's server-side Lua as one library (``kvstore.net.server_code``): what every store
runs, and what ``kvstore functions load`` loads once as the admin."""

from __future__ import annotations

from kvstore.fleet.generations import BUMP, RAISE
from kvstore.fleet.handoff import CLAIM_RECORDS
from kvstore.net.server_code import Library
from kvstore.values.drop_select import CLAIM, RELEASE

LIBRARY = Library([CLAIM, RELEASE, CLAIM_RECORDS, BUMP, RAISE])
