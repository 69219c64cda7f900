"""``python -m train CONFIG [key=value ...]``"""

import sys

from train.cli import main

sys.exit(main())
