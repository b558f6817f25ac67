"""`python -m hybridserve serve ...`: the same as the `hybridserve` command."""
import sys

from hybridserve.cli import main

sys.exit(main())
