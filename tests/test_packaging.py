"""One source of truth for the pins, and a package that declares what it imports.

requirements.txt pins what the project runs with; pyproject.toml's extras must pin the same versions
(the exact bits depend on the MLX build), and every third-party module the package imports must be
installed by the extra that its code needs: the client by the base install, the server by [server],
the reliability battery by [dev].
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "inference_engine"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OPTIONAL = {"coverage"}  # process_exit saves a measured run's coverage when coverage is there (tests only)
CLIENT_MODULES = ("client/__init__.py", "client/cli.py", "client/client.py", "client/connection.py",
                  "client/connect_errors.py", "address.py", "launch.py", "version.py", "__main__.py",
                  "security/__init__.py", "security/settings.py", "security/credentials.py", "security/tokens.py")


def _requirements_txt() -> dict[str, Requirement]:
    """requirements.txt's runtime, operator, shard, kernel, stub and test pins (the bench's own file is apart)."""
    reqs = [Requirement(line.split("#")[0].strip()) for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.split("#")[0].strip()]
    return {f"{canonicalize_name(r.name)} {r.marker}": r for r in reqs}


def _extra(name: str) -> dict[str, Requirement]:
    reqs = [Requirement(text) for text in PROJECT["optional-dependencies"][name]]
    return {f"{canonicalize_name(r.name)} {r.marker}": r for r in reqs if canonicalize_name(r.name) != "inference-engine"}


MODEL_EXTRAS = [name for name in PROJECT["optional-dependencies"] if name not in ("server", "dev", "bench")]  # wheels


def test_the_bench_extra_pins_what_requirements_bench_txt_pins_and_ci_never_installs_it():
    bench = [Requirement(line.split("#")[0].strip()) for line in (REPO / "requirements-bench.txt").read_text()
             .splitlines() if line.split("#")[0].strip()]
    assert sorted(map(str, bench)) == sorted(map(str, _extra("bench").values())) and bench
    assert all(str(r.specifier).startswith("==") for r in bench)
    ci = {canonicalize_name(r.name) for r in _requirements_txt().values()}
    assert not {canonicalize_name(r.name) for r in bench} & ci, "CI installs requirements.txt: it must not build the peer"


def test_extras_pin_exactly_what_requirements_txt_pins():
    pinned = _requirements_txt()
    server, dev = _extra("server"), _extra("dev")
    models = {k: r for name in MODEL_EXTRAS for k, r in _extra(name).items()}
    assert not set(server) & set(dev) and not set(models) & (set(server) | set(dev)), "a pin belongs to one extra"
    declared = {**server, **dev, **models}
    assert sorted(declared) == sorted(pinned), "requirements.txt and the extras list other packages"
    for key, req in declared.items():
        assert (str(req.specifier), req.extras) == (str(pinned[key].specifier), pinned[key].extras), key
        assert str(req.specifier).startswith("=="), f"{key}: pin an exact version"
    assert "inference_engine[server]" in PROJECT["optional-dependencies"]["dev"]
    for text in PROJECT["dependencies"]:  # the client's floors admit the server's pins
        req = Requirement(text)
        server_pin = next(r for r in server.values() if canonicalize_name(r.name) == canonicalize_name(req.name))
        assert req.specifier.contains(next(iter(server_pin.specifier)).version), text


def _imports(path: Path) -> set[str]:
    """Dotted names of the third-party modules a file imports (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] != "inference_engine"}


@functools.cache  # the same modules are imported by many files; scanning the installed files once each is enough
def _owner(module: str) -> str:
    """The distribution whose files hold `module` (namespace packages such as `google` span several)."""
    candidates = _packages_distributions()[module.split(".")[0]]
    parts = tuple(module.split("."))
    for dist in candidates:
        for f in md.distribution(dist).files or ():
            stem = Path(f).with_suffix("").parts if Path(f).suffix == ".py" else Path(f).parts
            if stem[: len(parts)] == parts or (stem[: len(parts) - 1] == parts[:-1] and len(stem) == len(parts)
                                                and stem[-1].split(".")[0] == parts[-1]):
                return canonicalize_name(dist)
    return canonicalize_name(candidates[0])


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    """Top-level module -> the distributions that provide it (every installed distribution's files, read once)."""
    return md.packages_distributions()


def _installed_by(requirements: list[Requirement]) -> set[str]:
    """Distributions these requirements install directly, with the ones their extras name (mlx[cpu]: mlx-cpu)."""
    env = default_environment()
    names: set[str] = set()
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        names.add(canonicalize_name(req.name))
        for extra in req.extras:
            for dep in map(Requirement, md.requires(req.name) or ()):
                if dep.marker is not None and dep.marker.evaluate({**env, "extra": extra}) and \
                        not dep.marker.evaluate({**env, "extra": ""}):
                    names.add(canonicalize_name(dep.name))
    return names


def test_every_import_is_declared_by_the_install_that_runs_it():
    base = [Requirement(t) for t in PROJECT["dependencies"]]
    server = base + list(_extra("server").values()) + [r for n in MODEL_EXTRAS for r in _extra(n).values()]
    dev = server + list(_extra("dev").values())
    installs = {"client": _installed_by(base), "server": _installed_by(server), "dev": _installed_by(dev)}
    missing = []
    battery = REPO / "scripts" / "reliabilitykit"  # the reliability battery runs from a checkout with [dev]
    for path in sorted(PACKAGE.rglob("*.py")) + sorted(battery.rglob("*.py")):
        rel = path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) else REPO).as_posix()
        install = "client" if rel in CLIENT_MODULES or rel.startswith("v1/") else \
            "dev" if rel.startswith("scripts/") else "server"
        for module in sorted(_imports(path)):
            if module.split(".")[0] in OPTIONAL or module.split(".")[0] == battery.name:
                continue
            owner = _owner(module)
            if owner not in installs[install]:
                missing.append(f"{rel} imports {module} ({owner}), not installed by the {install} install")
    assert not missing, "\n".join(missing)
    assert {"grpcio-status", "googleapis-common-protos", "prometheus-client", "nanobind"} <= installs["server"]


def test_the_wheel_carries_every_native_source():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["inference_engine"]
    native = sorted(p.name for p in (PACKAGE / "native").iterdir())
    assert native and all(any(Path("native", name).match(pattern) for pattern in data) for name in native), native
