"""``python -m lct``: the same command as ``lct``."""

from lct.cli.main import main

if __name__ == "__main__":
    main()
