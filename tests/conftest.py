"""Recipe-level tests import their shared helpers (elastic_rig) by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
