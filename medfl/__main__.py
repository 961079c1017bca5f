"""``python -m medfl``: the ``medfl`` command (:func:`medfl.cli.main`), for an environment whose
scripts folder is not on ``PATH``."""

from __future__ import annotations

import sys

from medfl.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
