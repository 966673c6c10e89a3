"""Prints what a launch sees of itself, as JSON (tests/test_launcher.py): argv, folder, the
environment it was given, `sys.path[0]`, its hash seed's effect, its parent, and whether the
libraries came preloaded; exits with the code its first argument names, after an atexit
handler writes a file (the interpreter's own end, not `os._exit`)."""

import atexit
import json
import os
import sys
from pathlib import Path

code = int(sys.argv[1])
marker = Path(sys.argv[2])
atexit.register(marker.write_text, "atexit ran")
print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            "probe": os.environ.get("PROBE"),
            "path0": sys.path[0],
            "hash": hash("asyncrl"),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "torch_preloaded": "torch" in sys.modules,
            "stdin": sys.stdin.read(),
        }
    ),
    flush=True,
)
print("to stderr", file=sys.stderr)
sys.exit(code)
