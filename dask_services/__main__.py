"""``python -m dask_services ...``: the ``dask-services`` command."""

import sys

from dask_services.cli import main

sys.exit(main())
