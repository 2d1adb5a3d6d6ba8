"""python -m timm_flashwin: the timm-flashwin command line."""
import sys

from .cli import main

sys.exit(main())
