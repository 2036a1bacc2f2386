"""One module per ``lowp`` subcommand (see :mod:`lowp.cli`)."""
