"""`python -m diag.cli`: the same entry point as the `diag` console script."""

from diag.cli import main

main()
