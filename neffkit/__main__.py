"""`python -m neffkit` runs the CLI, so tests can drive the real command in a subprocess."""

from neffkit.cli import main

main()
