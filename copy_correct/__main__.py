"""``python -m copy_correct``: the ``copy-correct`` command (``copy_correct.cli``)."""

import sys

from copy_correct.cli import main

if __name__ == "__main__":
    sys.exit(main())
