import sys

from dres.train.cli import main

sys.exit(main())
