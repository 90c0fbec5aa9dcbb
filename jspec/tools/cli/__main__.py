"""`python -m jspec.tools.cli ...`: the `jspec` command."""
import sys

from jspec.tools.cli import main

sys.exit(main())
