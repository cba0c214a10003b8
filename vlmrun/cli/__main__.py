"""`python -m vlmrun.cli`: the same command line as `vlmrun`."""

from vlmrun.cli import main

main()
