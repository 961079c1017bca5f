"""``python -m medfl.cli``: the ``medfl`` command (:func:`medfl.cli.main`), as ``python -m medfl``."""

import sys

from medfl.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
