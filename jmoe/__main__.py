import sys

from jmoe.cli import main

sys.exit(main())
