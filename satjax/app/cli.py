"""The ``satjax`` command line: ``satjax <command> [options]``.

Each command lives next to the code it drives and is imported lazily, so that
``satjax serve-queue`` does not pay for importing the model.
"""

from __future__ import annotations

import importlib
import os
import sys

from satjax import __version__
from satjax.utils import retain_freed_memory

EXIT_FAILED = 1  # a command that failed (0: done, 2: a user error, 130: interrupted)

# command -> (module, function taking argv list and returning an exit code, help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("satjax.app.commands", "train",
              "asynchronous RL training (queue + workers + trainer)"),
    "sft": ("satjax.app.commands", "sft", "only the supervised warm-up (cached in <run_dir>/sft)"),
    "serve-queue": ("satjax.queue.server", "main", "run the gRPC trajectory queue server"),
    "rollout": ("satjax.app.worker_process", "main",
                "run one rollout worker (train starts these itself)"),
    "eval": ("satjax.app.commands", "evaluate", "avg@k and pass@k on the held-out split"),
    "export": ("satjax.app.commands", "export",
               "a published version (full or delta) as a complete Hugging Face model"),
    "lag-sweep": ("satjax.app.lag_sweep", "main", "objectives x lags x seeds experiment"),
    "plan": ("satjax.app.plan", "main",
             "compile a run for a TPU slice (no TPU needed): per-chip memory, FLOPs, "
             "collectives"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
    except BrokenPipeError:  # e.g. `satjax -h | head`: the reader left; not an error of ours
        # Python flushes stdout again at exit; point it at /dev/null so that is silent too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if code == EXIT_FAILED:
        # A failed command ends here rather than in Python's exit, which joins every
        # non-daemon thread: a failure can leave a library's thread blocked for good (after
        # a checkpoint save into a read-only directory, Orbax's async-save threads never
        # finish), and the process would never end. The command has printed its line,
        # stopped its children and closed its files; only buffered output is left to write.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:
        print(f"satjax {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: satjax <command> [options]   (satjax <command> -h: its options)\n\n"
              "commands:")
        for name, (_, _, help_) in COMMANDS.items():
            print(f"  {name:<14} {help_}")
        print("\noptions:\n  -h, --help     show this message\n"
              "  --version      print the version")
        sys.stdout.flush()  # inside the try: a closed pipe raises here, not at exit
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"satjax: error: unknown command {name!r}; one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    # every command moves messages of megabytes (trajectories, weights): reuse freed memory
    # instead of faulting in fresh pages for each (utils.retain_freed_memory)
    retain_freed_memory()
    code = int(getattr(importlib.import_module(module), func)(rest) or 0)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
