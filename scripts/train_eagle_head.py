"""Train an EAGLE-1 head: `jspec train eagle --help` (`jspec.tools.cli.train_eagle`)."""
from jspec.tools.cli.train_eagle import main

if __name__ == "__main__":
    main()
