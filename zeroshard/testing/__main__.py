"""``python -m zeroshard.testing parity module:factory [options]`` (see ``cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
