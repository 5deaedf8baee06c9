"""What a user installs: the wheel ``pip install .`` builds holds every module of the source tree,
and, installed (not editable) in a fresh virtual environment, ``pykv`` runs a command of each kind.

The editable install the rest of the suite uses reads the source tree directly, so a package
missing from the wheel (``pykv.calibration`` once) fails only here.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow



def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _source_modules() -> set[str]:
    return {str(path.relative_to(REPO)) for path in (REPO / "pykv").rglob("*.py")
            if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                 cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("pykv-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, Path]:
    """A fresh venv (no system site packages, no vLLM) with the wheel and its dependencies."""
    base = tmp_path_factory.mktemp("venv")
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=base)
    assert made.returncode == 0, made.stderr
    pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], cwd=base)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return {"venv": venv, "cwd": _shadowed_cwd(base)}


def _shadowed_cwd(base: Path) -> Path:
    """A working directory holding a folder named ``pykv`` that is not pykv: what runs must not
    import it (the clone's parent directory looks like this)."""
    cwd = base / "cwd"
    (cwd / "pykv").mkdir(parents=True)
    (cwd / "pykv" / "__init__.py").write_text("raise ImportError('the folder in the current directory')\n")
    return cwd


def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
    missing = sorted(_source_modules() - shipped)
    assert missing == [], f"modules missing from the wheel: {missing}"


def test_the_wheels_python_requirement_admits_what_the_code_needs(wheel):
    """``enum.StrEnum`` (3.11) is used: the metadata must not promise 3.10."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    assert "Requires-Python: >=3.11" in lines
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared == ">=3.11"


def test_every_installed_module_imports_without_the_source_tree(installed):
    python = installed["venv"] / "bin" / "python"
    result = _run([str(python), "-P", "-m", "pykv.selfcheck", "--own-only"], cwd=installed["cwd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed["venv"]), result.stdout  # not the checkout


def test_the_installed_cli_runs_a_command_of_each_kind(installed, tmp_path):
    pykv = str(installed["venv"] / "bin" / "pykv")
    env = {"PATH": f"{installed['venv'] / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return _run([pykv, *args], cwd=installed["cwd"], env=env, timeout=120)

    assert run("--help").returncode == 0
    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == "pykv 0.1.0", version.stdout + version.stderr
    tree = tmp_path / "tree"
    for args in (("init", str(tree)), ("inspect", str(tree)), ("fsck", str(tree)),
                 ("gc", str(tree), "--max-size", "1G"), ("config", "--root", str(tree)),
                 ("completions", "show", "--shell", "bash"), ("bench", "--path", str(tmp_path), "--size", "8M",
                                           "--block-size", "1M", "--depth", "1", "--no-files", "--no-fio")):
        result = run(*args)
        assert result.returncode == 0, (args, result.stdout + result.stderr)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    # The engine commands need vLLM, which this environment lacks: one line saying so, no traceback.
    for args in (("demo",), ("warm", str(tmp_path / "prompts.jsonl"), "--model", "m", "--root", str(tree))):
        result = run(*args)
        assert result.returncode != 0 and "Traceback" not in result.stderr, (args, result.stderr)
        assert "needs vLLM" in result.stderr, (args, result.stderr)



def test_the_selfcheck_names_each_module_that_does_not_import(monkeypatch):
    """What install.sh runs: a pykv module missing fails; with --own-only a missing vLLM does not."""
    import importlib

    from pykv import selfcheck

    real = importlib.import_module

    def fake(name: str, *args, **kwargs):
        if name == "pykv.connector.manager":
            raise ModuleNotFoundError("No module named 'pykv.calibration'", name="pykv.calibration")
        if name == "pykv.connector.worker":
            raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(selfcheck.importlib, "import_module", fake)
    failed = selfcheck.failed_imports()
    assert [line.split(":")[0] for line in failed] == ["pykv.connector.manager", "pykv.connector.worker"]
    assert "pykv.calibration" in failed[0]
    assert [line.split(":")[0] for line in selfcheck.failed_imports(own_only=True)] == ["pykv.connector.manager"]
