"""Train an EAGLE-3 head: `jspec train eagle3 --help` (`jspec.tools.cli.train_eagle3`)."""
from jspec.tools.cli.train_eagle3 import main

if __name__ == "__main__":
    main()
