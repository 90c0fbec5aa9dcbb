"""The paper methods, each a preset of the engine's parts (`jspec.strategy.Speculative`)."""
