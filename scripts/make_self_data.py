"""Write a registered model's self-written training data: `jspec train self-data --help` (`jspec.tools.cli.self_data`)."""
from jspec.tools.cli.self_data import main

if __name__ == "__main__":
    main()
