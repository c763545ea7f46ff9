"""The ``satjax`` command line: ``satjax <command> [options]``.

Each command lives next to the code it drives and is imported lazily, so that
``satjax serve-queue`` does not pay for importing the model.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, function taking argv list and returning an exit code, help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("satjax.app.commands", "train",
              "asynchronous RL training (queue + workers + trainer)"),
    "sft": ("satjax.app.commands", "sft", "supervised warm-up of the tiny policy"),
    "serve-queue": ("satjax.queue.server", "main", "run the gRPC trajectory queue server"),
    "rollout": ("satjax.app.worker_process", "main", "run one rollout worker"),
    "eval": ("satjax.app.commands", "evaluate", "avg@k and pass@k on the held-out split"),
    "lag-sweep": ("satjax.app.lag_sweep", "main", "objectives x lags x seeds experiment"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: satjax <command> [options]\n\ncommands:")
        for name, (_, _, help_) in COMMANDS.items():
            print(f"  {name:<14} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"satjax: unknown command {name!r}; one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
