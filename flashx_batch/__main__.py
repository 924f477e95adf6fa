"""`python -m flashx_batch conf=NAME ...` — see flashx_batch/cli.py."""

from flashx_batch.cli import main

if __name__ == "__main__":
    main()
