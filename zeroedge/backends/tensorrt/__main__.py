"""`python -m zeroedge.backends.tensorrt build|generate` (cli.main)."""
import sys

from zeroedge.backends.tensorrt.cli import main

sys.exit(main())
