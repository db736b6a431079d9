"""The GPU kit's manifest: what the kit was built for and from, and the checks run.sh
makes before it installs anything.

    python manifest.py write KIT --python 3.12 --torch 2.11.0+cu130 --cc 90 --repo R --max-mib 60
        [--inputs HASH]
    python manifest.py check KIT     # this machine's Python and torch are the kit's, its files whole
    python manifest.py fresh KIT --inputs HASH   # exit 0: built from these inputs, files whole

`write` records the target (Python, torch with its CUDA, compute capabilities), the
repository's commit, every file's size and SHA-256, and fails when the kit and the
repository's files would not fit the device call (KIT_MAX_MIB). `check` exits 2 with one
line naming what differs: a kit built for another Python or torch than this machine's
cannot load (Horovod's extension is built against one torch's ABI), and a file that
changed since the build would be a check of something else. `fresh` tells build.sh
whether the kit can be kept: it records the hash of what it was built from (`--inputs`),
and its files are the ones recorded. Standard library only: it runs before anything is
installed.
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

NAME = "manifest.json"


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(kit):
    return sorted(p for p in Path(kit).rglob("*") if p.is_file() and p.name != NAME)


def _git(repo, *args):
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _repo_bytes(repo):
    """The bytes the device call sends besides the kit: tracked and untracked files git
    does not ignore."""
    listed = _git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is None:
        return None
    return sum((Path(repo) / name).stat().st_size for name in listed.split("\0")
               if name and (Path(repo) / name).is_file())


def write(args):
    kit = Path(args.kit)
    files = {str(p.relative_to(kit)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(kit)}
    kit_bytes = sum(f["bytes"] for f in files.values())
    repo_bytes = _repo_bytes(args.repo)
    status = _git(args.repo, "status", "--porcelain")
    manifest = {
        "format": "pipe_horovod.gpu-kit/1",
        "target": {"python": args.python, "torch": args.torch, "cuda_cc": args.cc},
        "built": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "host": platform.node(), "python": platform.python_version(),
                  # the build's environment: the GPU machine's Python and torch, and of
                  # the rest only what its image has, so the rehearsal runs in it
                  "python_path": sys.executable,
                  "commit": _git(args.repo, "rev-parse", "HEAD"),
                  "inputs": args.inputs,
                  "uncommitted_changes": bool(status) if status is not None else None},
        "kit_bytes": kit_bytes, "repo_bytes": repo_bytes,
        "files": files,
    }
    total = kit_bytes + (repo_bytes or 0)
    if total > args.max_mib * 2**20:
        sys.exit(f"make gpu-kit: the kit ({kit_bytes / 2**20:.1f} MiB) and the repository "
                 f"({(repo_bytes or 0) / 2**20:.1f} MiB) come to {total / 2**20:.1f} MiB, over "
                 f"the {args.max_mib} MiB the device call may carry (scripts/gpu_kit/target.env)")
    (kit / NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"[gpu-kit] manifest: {len(files)} files, kit {kit_bytes / 2**20:.1f} MiB + "
          f"repository {(repo_bytes or 0) / 2**20:.1f} MiB")


def _changed(kit, files):
    """Why the kit's files are not the ones `files` (the manifest's) records, or None."""
    for name, want in files.items():
        file = Path(kit) / name
        if not file.is_file():
            return f"the kit's file {name} is missing: rebuild it (make gpu-kit)"
        if file.stat().st_size != want["bytes"] or _sha256(file) != want["sha256"]:
            return f"the kit's file {name} changed since it was built: rebuild it (make gpu-kit)"
    return None


def fresh(kit, inputs):
    """Whether the kit was built from `inputs` (build.sh's hash) and is whole."""
    path = Path(kit) / NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    files = manifest.get("files", {})
    return (manifest.get("built", {}).get("inputs") == inputs and _changed(kit, files) is None
            and {str(p.relative_to(kit)) for p in _files(kit)} == set(files))


def problem(kit):
    """Why this machine cannot use the kit, or None."""
    path = Path(kit) / NAME
    if not path.is_file():
        return f"no {path}: build the kit first (make gpu-kit)"
    manifest = json.loads(path.read_text())
    target = manifest["target"]
    python = ".".join(platform.python_version_tuple()[:2])
    if python != target["python"]:
        return (f"the kit is built for Python {target['python']}, this machine's python is "
                f"{platform.python_version()} ({sys.executable}): rebuild it for this one "
                "(scripts/gpu_kit/target.env)")
    changed = _changed(kit, manifest["files"])       # before torch's import: seconds
    if changed:
        return changed
    try:
        import torch
    except ImportError as exc:
        return f"the kit needs torch {target['torch']}, which does not import here ({exc})"
    if torch.__version__ != target["torch"]:
        return (f"the kit is built for torch {target['torch']}, this machine has torch "
                f"{torch.__version__}: Horovod's extension would not load; rebuild the kit "
                "for it (scripts/gpu_kit/target.env)")
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("kit")
    w.add_argument("--python", required=True)
    w.add_argument("--torch", required=True)
    w.add_argument("--cc", required=True)
    w.add_argument("--repo", required=True)
    w.add_argument("--max-mib", type=float, required=True)
    w.add_argument("--inputs", default=None, help="the hash of what the kit is built from")
    c = sub.add_parser("check")
    c.add_argument("kit")
    f = sub.add_parser("fresh")
    f.add_argument("kit")
    f.add_argument("--inputs", required=True)
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args)
        return 0
    if args.command == "fresh":
        return 0 if fresh(args.kit, args.inputs) else 1
    why = problem(args.kit)
    if why:
        print(f"run.sh: {why}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
