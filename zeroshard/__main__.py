"""``python -m zeroshard <command>``: ``demo`` trains a small GPT on CPU ranks.

No part of ZeRO lives here: it only dispatches to a command's module
(``zeroshard.demo``, which trains with FULL_SHARD by default, next to torch
FSDP1 as the reference).
"""
import sys

COMMANDS = {"demo": "zeroshard.demo"}


def main() -> int:
    usage = f"usage: python -m zeroshard {{{','.join(COMMANDS)}}} [options]  (add --help after a command)"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
