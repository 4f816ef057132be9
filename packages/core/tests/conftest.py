"""Makes the shared fakes of core's tests (`trainer_fakes`) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
