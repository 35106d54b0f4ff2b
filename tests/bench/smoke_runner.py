"""Runs benchmarks' ``--smoke`` modes one after another in this one process, as
``tests/bench/test_smoke.py`` asks: each would otherwise import torch and diffusers
again and start fork servers of its own (about 10 CPU s before its first job; the
smoke runs took 261 CPU s as processes of their own, 137 here).

    python tests/bench/smoke_runner.py OUT TMP SCRIPT...

Every script runs with ``TMP`` as its temporary directory (one for all of them: a
fork server serves only children of its own ``TMPDIR``). For each script, in
order: its output (file descriptors 1 and 2, so that what its children print is
there too) in ``OUT/SCRIPT.stdout`` and ``.stderr``, then its exit code in
``OUT/SCRIPT.rc``. Between scripts, what one changed that the next would see is
put back: the environment, the arguments, signal handlers, torch's thread count,
the working directory, and what it left in the temporary directory. A script past
``TIMEOUT_S`` has every thread's traceback written to its ``.stderr`` and ends
this process (exit code 1): the caller starts another for the scripts after it."""

from __future__ import annotations

import faulthandler
import os
import runpy
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.ops.postgres_as_root import discard_clusters_of  # noqa: E402

TIMEOUT_S = 240
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)


def exit_code(exc: SystemExit) -> int:
    """What ``raise SystemExit(value)`` exits a process with (a message: 1, printed)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run(script: str) -> int:
    """``bench/SCRIPT.py --smoke`` as ``python bench/SCRIPT.py --smoke`` runs it: its exit code."""
    path = REPO / "bench" / f"{script}.py"
    sys.argv = [str(path), "--smoke"]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def run_apart(script: str, out: Path) -> int:
    """``run(script)`` with its output in ``out`` and what it changed put back after it."""
    import torch

    env, argv, cwd, threads = dict(os.environ), list(sys.argv), os.getcwd(), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.iterdir())
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out / f"{script}.stdout", "wb") as stdout, open(out / f"{script}.stderr", "wb") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        faulthandler.dump_traceback_later(TIMEOUT_S, exit=True, file=stderr)
        try:
            code = run(script)
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    os.chdir(cwd)
    torch.set_num_threads(threads)
    for sig, handler in handlers.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    clear(tmp, keep=before)
    return code


def clear(tmp: Path, keep: set[Path] | frozenset[Path] = frozenset()) -> None:
    """What a script left in ``tmp`` but ``keep``: its stacks' data directories (tens of
    MB each) and, as root, their PostgreSQL clusters, which live outside them."""
    for left in set(tmp.iterdir()) - keep:
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)
    discard_clusters_of(tmp)


def main(argv: list[str]) -> int:
    out, tmp, scripts = Path(argv[0]), Path(argv[1]).resolve(), argv[2:]
    if not tmp.is_dir() or any(tmp.iterdir()):
        # What it leaves there is removed after each script, PostgreSQL clusters included.
        raise SystemExit(f"{tmp}: not an empty directory of this run's own")
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    for script in scripts:
        code = run_apart(script, out)
        (out / f"{script}.rc").write_text(f"{code}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
