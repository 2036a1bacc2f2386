"""``python -m lowp``: the ``lowp`` command line (:func:`lowp.cli.main`)."""
import sys

from lowp.cli import main

sys.exit(main())
