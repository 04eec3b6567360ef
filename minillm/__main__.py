import sys

from minillm.cli import main

sys.exit(main())
