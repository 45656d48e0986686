"""`python -m pipelines.cli ...`: the `groupforge` command."""

from pipelines.cli.main import main

main()
