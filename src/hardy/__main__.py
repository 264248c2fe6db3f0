"""`python -m hardy`: the `hardy` command, where its script is not on PATH (a virtual environment
used without activating it); `python -m hardy.cli` runs the same command."""

from .cli import main

main()
