"""The import contracts in pyproject.toml ([tool.importlinter]), checked by import-linter: no import cycles in any
package (imports inside functions count: they once hid three), and no module imports one from a higher layer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each top-level folder is installed (pyproject.toml's package-dir): import-linter reads a package from disk,
# so it is checked as a wheel lays it out
INSTALLED_AS = {"collab": "collab", "peers": "collab/peers", "dashboard": "collab/dashboard",
                "configs": "collab/configs"}


def test_import_contracts_are_kept(tmp_path):
    for folder, installed in INSTALLED_AS.items():
        shutil.copytree(ROOT / folder, tmp_path / installed, ignore=shutil.ignore_patterns("__pycache__"))
    beside = Path(sys.executable).with_name("lint-imports")  # the test extra's, in this Python's environment
    lint = beside if beside.exists() else shutil.which("lint-imports")
    assert lint, "lint-imports is missing: it comes with the test extra (import-linter)"
    result = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout, result.stdout[-2000:]


def test_the_cli_parses_without_the_heavy_libraries():
    """Every invocation builds the parser from every command module, so they import torch, hivemind, transformers
    and fastapi only inside run(): that is why imports sit inside functions there (collab.commands)."""
    probe = ("import sys, collab.cli as cli; cli.build_parser(); "
             "print(sorted(m for m in ('torch', 'hivemind', 'transformers', 'fastapi') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
