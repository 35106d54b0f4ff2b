"""Regenerates the Python gRPC code from ``protos/``: ``python -m services.rpc.codegen``.

``--check`` regenerates into a scratch folder and fails if the committed code
differs, which is how CI catches a proto edited without regenerating.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
GEN = Path(__file__).resolve().parent / "gen"
PACKAGE = "services.rpc.gen"


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # protoc writes imports relative to the proto root ("from darkroom.v1 import");
    # the generated code lives inside this package, so root them here.
    for path in out.rglob("*.py*"):
        text = re.sub(r"^from darkroom\.", f"from {PACKAGE}.darkroom.", path.read_text(), flags=re.M)
        path.write_text(text)
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if files_a != files_b:
        return False
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        generate(fresh)
        if args.check:
            if not _same_tree(fresh, GEN):
                print("generated gRPC code is stale: run `python -m services.rpc.codegen`", file=sys.stderr)
                return 1
            print("generated gRPC code is up to date")
            return 0
        shutil.rmtree(GEN, ignore_errors=True)
        shutil.copytree(fresh, GEN)
    print(f"wrote {GEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
