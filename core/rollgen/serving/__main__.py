"""``python -m rollgen.serving CONN_FD SOCKET_FD``: the server's own process (``rollgen.serve``
starts it; see ``rollgen.serving.front.main``)."""

import sys

from rollgen.serving.front import main

main(int(sys.argv[1]), int(sys.argv[2]))
