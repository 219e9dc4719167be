"""``python -m p2p_diloco`` is the ``p2p-diloco`` command."""

from p2p_diloco.cli.main import run_main

if __name__ == "__main__":
    run_main()
