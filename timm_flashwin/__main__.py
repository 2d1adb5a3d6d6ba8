"""python -m timm_flashwin: the timm-flashwin command line."""
import sys

from .tools.cli import main

sys.exit(main())
