"""The `jetrl` command line: every command module is imported to list its options, so none may
import torch or torchtitan at the top (they cost seconds before `jetrl --help` answers, and
before every command that needs neither)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_listing_the_commands_imports_no_torch() -> None:
    probe = (
        "import json, sys\n"
        "from jetrl.deploy.cli import build_parser\n"
        "build_parser()\n"
        "print(json.dumps(sorted(m for m in ('torch', 'torchtitan', 'transformers') if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
