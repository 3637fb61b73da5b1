"""`python -m gradian VERB ...` (and `torchrun ... -m gradian VERB ...`): the same CLI as the `gradian` script."""

from .cli import main

if __name__ == "__main__":
    main()
