"""``python -m lmcache_tiered.cli``: the ``lmcache-tiered`` command."""

import sys

from lmcache_tiered.cli import main

sys.exit(main())
