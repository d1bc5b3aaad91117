import sys

from mindio_ttp.demo import main

sys.exit(main())
