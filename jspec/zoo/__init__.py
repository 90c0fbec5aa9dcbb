"""The synthetic multimodal world (`world`), its tokenizer (`tokenizer`) and training / evaluation data (`data`)."""
