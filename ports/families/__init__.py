"""One module per model family (text model, vision tower, image tokenizer): its config, parameters, key map and
forward. Imports only `ports.core` and other families."""
