"""`python -m mindio_ttp.control.agent FD`: a node agent process (started by process.py)."""

import sys

from mindio_ttp.control.agent.process import serve

if len(sys.argv) != 2 or not sys.argv[1].isdigit():
    print("usage: python -m mindio_ttp.control.agent FD (started by a rank)", file=sys.stderr)
    sys.exit(2)
sys.exit(serve(int(sys.argv[1])))
