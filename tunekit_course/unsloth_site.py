"""The folder of packages Unsloth runs from in `tunekit bench --compare`: `python -m tunekit_course.unsloth_site`.

Unsloth pins packages that tunekit's environment holds at other versions (datasets < 5, trl <= 1.15.0,
transformers <= 5.17.0 for Unsloth 2026.10.9), so the comparison runs it in a process of its own with a folder of
its packages put before the environment's on the path (`compare.unsloth_env`). This builds that folder, `.unsite/`
in the checkout by default, which is where `--compare` looks.

What goes in is read from Unsloth's own requirements, not a list kept here: starting from `unsloth` and
`unsloth-zoo`, each requirement of a package in the folder that neither the folder nor the environment satisfies
is downloaded as a wheel (the newest that satisfies it, without its dependencies) and unpacked there, until nothing
is missing. A requirement the environment already meets takes nothing, so the folder holds only what the
environment lacks or holds at a version Unsloth refuses. Packages built against one torch release (torchvision,
xformers) or that training never imports (diffusers) are left out and listed: Unsloth imports without them, and
a torchvision or xformers for another torch would break its import instead.

`--python-version 3.12 --environment FREEZE` builds the folder for another machine (a GPU machine without
network access): its interpreter's version and `pip freeze` (which packages it already has), manylinux x86-64
wheels only. `--keep-cuda 130` keeps bitsandbytes' GPU library for that CUDA release only (the others, ROCm and
XPU ones included, are most of its wheel); by default, building for this machine, the release of this torch.
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

UNSLOTH = "2026.10.9"  # the release the published comparisons ran; --unsloth picks another
# Never put in the folder: built against one torch release (a mismatched one breaks `import unsloth`, which
# imports without them), the torch stack itself (the environment's is the one being measured), or never imported
# by training (diffusers: image models).
LEFT_OUT = {"torch": "the environment's own torch is the one measured",
            "torchvision": "built for one torch release; Unsloth imports without it",
            "xformers": "built for one torch release; Unsloth uses PyTorch's attention without it",
            "triton": "comes with the environment's torch", "triton-windows": "Windows only",
            "diffusers": "image models; training a language model never imports it",
            "hf-transfer": "faster hub downloads when HF_HUB_ENABLE_HF_TRANSFER=1; nothing imports it otherwise"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any")


def read_freeze(path: str | Path) -> dict[str, str]:
    """{canonical name: version} of a `pip freeze` listing; a line that is neither NAME==VERSION, a comment nor a
    reference (`-e`, `@ file:`) is refused naming its line."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "-")) or " @ " in line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}, line {n}: {line!r} is not NAME==VERSION; give the output of `pip freeze`")
        out[canonicalize_name(m[1])] = m[2]
    return out


def installed_here(apart: Path | None = None) -> dict[str, str]:
    """{canonical name: version} of the packages this interpreter imports, less those found in folder `apart` (the
    folder being rebuilt, should it be on the path)."""
    out = {}
    for d in metadata.distributions():
        where = Path(str(d.locate_file(""))).resolve()
        if d.metadata["Name"] and not (apart and where.is_relative_to(apart.resolve())):
            out.setdefault(canonicalize_name(d.metadata["Name"]), d.version)  # the first on the path is imported
    return out


def in_site(site: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, its Requires-Dist lines)} of the wheels unpacked in `site`."""
    out = {}
    for meta in glob.glob(str(site / "*.dist-info" / "METADATA")):
        msg = Parser().parsestr(Path(meta).read_text(encoding="utf-8"))
        out[canonicalize_name(msg["Name"])] = (msg["Version"], msg.get_all("Requires-Dist") or [])
    return out


def marker_env(python_version: str | None) -> dict[str, str]:
    """The environment requirement markers are read in: this interpreter's, or Linux x86-64 at PYTHON_VERSION."""
    env = default_environment()
    if python_version:
        env.update(python_version=python_version, python_full_version=f"{python_version}.0", sys_platform="linux",
                   platform_system="Linux", platform_machine="x86_64", os_name="posix",
                   implementation_name="cpython", platform_python_implementation="CPython")
    return env


def missing(site: dict, have: dict[str, str], env: dict[str, str]) -> tuple[dict[str, Requirement], dict[str, str]]:
    """What the folder's packages require that neither the folder nor the environment (`have`) satisfies:
    ({name: the requirement, specifiers of every package asking for it joined}, {name left out: why})."""
    wanted: dict[str, Requirement] = {}
    for _, requires in site.values():
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name in wanted:
                wanted[name].specifier &= req.specifier
            else:
                wanted[name] = Requirement(f"{name}{req.specifier}")
    todo, left = {}, {}
    for name, req in sorted(wanted.items()):
        version = site[name][0] if name in site else have.get(name)
        if version is not None and req.specifier.contains(Version(version), prereleases=True):
            continue
        if name in LEFT_OUT:
            left[name] = LEFT_OUT[name]
        else:
            todo[name] = req
    return todo, left


def _download(reqs: list[str], into: Path, python_version: str | None) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "-d", str(into), *reqs]
    if python_version:
        abi = "cp" + python_version.replace(".", "")
        cmd += ["--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not download {' '.join(reqs)}:\n{proc.stderr.strip()[-2000:]}")


def _unpack(wheels: Path, site: Path) -> list[str]:
    got = []
    for whl in sorted(wheels.glob("*.whl")):
        name = whl.name.split("-")[0]
        for stale in site.glob(f"{name}-*.dist-info"):  # an older version it replaces: one record per package
            shutil.rmtree(stale)
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        got.append(f"{name} {whl.name.split('-')[1]}")
        whl.unlink()
    return got


def _keep_cuda(site: Path, release: str) -> int:
    """Delete bitsandbytes' GPU libraries other than the one for CUDA RELEASE (e.g. 130): other CUDA releases,
    ROCm, XPU (the CPU one stays); bytes freed."""
    freed = 0
    for lib in (site / "bitsandbytes").glob("libbitsandbytes_*.so"):
        if lib.name not in (f"libbitsandbytes_cuda{release}.so", "libbitsandbytes_cpu.so"):
            freed += lib.stat().st_size
            lib.unlink()
    return freed


def build(site: str | Path, python_version: str | None = None, environment: str | Path | None = None,
          unsloth: str = UNSLOTH, keep_cuda: str | None = None, rounds: int = 8, verbose: bool = True) -> dict:
    """Build the folder (replacing one there) and return {"installed": [...], "left_out": {name: why}}."""
    site = Path(site)
    have = read_freeze(environment) if environment else installed_here(apart=site)
    env = marker_env(python_version)
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    installed, left = [], {}
    reqs = [f"unsloth=={unsloth}", f"unsloth-zoo=={unsloth}"]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            if verbose:
                print("downloading", " ".join(reqs), flush=True)
            _download(reqs, Path(tmp), python_version)
            installed += _unpack(Path(tmp), site)
            todo, newly_left = missing(in_site(site), have, env)
            left.update(newly_left)
            reqs = [str(r) for r in todo.values()]
            if not reqs:
                break
        if reqs:
            raise RuntimeError(f"still missing after {rounds} rounds of downloads: {', '.join(reqs)}")
    if (site / "studio").is_dir():  # Unsloth Studio, the web app its wheel carries (82 MB): nothing imports it
        shutil.rmtree(site / "studio")
    if keep_cuda and (site / "bitsandbytes").is_dir():
        _keep_cuda(site, keep_cuda)
    return {"installed": installed, "left_out": left}


def check_import(site: str | Path) -> tuple[bool, str]:
    """Import Unsloth the way the comparison's process does (`compare.unsloth_env`): (imported, its last output
    lines). Unsloth refuses to import without a GPU."""
    from tunekit_course.compare import unsloth_env

    code = "import unsloth, trl, datasets, transformers; print('unsloth', unsloth.__version__, 'trl', trl.__version__, " \
           "'datasets', datasets.__version__, 'transformers', transformers.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], env=unsloth_env(str(site)), capture_output=True, text=True,
                          check=False, timeout=600)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
    return proc.returncode == 0, tail


def main(argv: list[str] | None = None) -> int:
    from tunekit.config import REPO_ROOT

    p = argparse.ArgumentParser(prog="python -m tunekit_course.unsloth_site", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO_ROOT / ".unsite"), help="the folder to build (default .unsite/)")
    p.add_argument("--unsloth", default=UNSLOTH, help=f"Unsloth's release (default {UNSLOTH})")
    p.add_argument("--python-version", default=None, help="build for another machine's Python (e.g. 3.12)")
    p.add_argument("--environment", default=None, help="with --python-version: that machine's `pip freeze`")
    p.add_argument("--keep-cuda", default=None, help="keep bitsandbytes' library for this CUDA release only (e.g. "
                   "130; default: this torch's release when building for this machine)")
    args = p.parse_args(argv)
    if args.python_version and not args.environment:
        p.error("--python-version needs --environment: the other machine's `pip freeze`, so that the folder holds "
                "only what it lacks")
    import torch  # after the arguments are checked: a wrong call is said at once, not after torch loads

    keep = args.keep_cuda
    if keep is None and not args.python_version:
        keep = (torch.version.cuda or "").replace(".", "") or None
    try:
        got = build(args.target, args.python_version, args.environment, args.unsloth, keep)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"unsloth_site: {e}", file=sys.stderr)
        return 2
    print(f"{len(got['installed'])} packages unpacked into {args.target}: {', '.join(got['installed'])}")
    for name, why in got["left_out"].items():
        print(f"  left out {name}: {why}")
    if args.python_version:
        print(f"copy {args.target} to that machine's checkout; `tunekit bench --compare` finds .unsite/ there")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: Unsloth imports only on a GPU, so the import was not checked")
        return 0
    ok, tail = check_import(args.target)
    print(("Unsloth imports from it: " if ok else "Unsloth does not import from it:\n") + tail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
