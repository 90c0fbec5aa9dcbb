"""Train an EESD early-exit head: `jspec train eesd --help` (`jspec.tools.cli.train_eesd`)."""
from jspec.tools.cli.train_eesd import main

if __name__ == "__main__":
    main()
