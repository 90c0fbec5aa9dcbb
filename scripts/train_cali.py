"""Train EESD's Cali-TS predictor: `jspec train cali --help` (`jspec.tools.cli.train_cali`)."""
from jspec.tools.cli.train_cali import main

if __name__ == "__main__":
    main()
