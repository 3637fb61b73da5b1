"""Stage 1, setup: the data records, their tokenization and batches, the model with its LoRA adapters, and the
session every verb opens on them."""
