"""A minimal real HTTP server for tests/test_servers.py: answers GET /health with 200 after
`--delay` seconds, optionally spawns a child process (its pid written to `--child-pid`) that
outlives a plain kill of this one, and can ignore SIGTERM (`--ignore-term`)."""

import argparse
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--child-pid", default=None)
parser.add_argument("--ignore-term", action="store_true")
args = parser.parse_args()
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.child_pid:
    child = subprocess.Popen([sys.executable, "-c", "import time, signal; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(args.child_pid, "w") as f:
        f.write(str(child.pid))
print("starting", flush=True)
time.sleep(args.delay)


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


HTTPServer(("127.0.0.1", args.port), Health).serve_forever()
