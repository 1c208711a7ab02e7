"""``python -m microspeed.cli``: the ``microspeed`` command."""

from microspeed.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
