"""``python -m qkv``: the same command as ``qkv`` (same arguments, output and exit status)."""

from qkv.cli import main

if __name__ == "__main__":
    main()
