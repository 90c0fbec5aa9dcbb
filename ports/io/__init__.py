"""Reading and writing checkpoints: Hugging Face layouts, GGUF, jspec's own format, the Hub. Sits above
`ports.model` (the registry of families)."""
