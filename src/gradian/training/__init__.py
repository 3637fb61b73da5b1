"""Training a LoRA adapter: the recipe (`recipe`) and Gradian's own deterministic loop (`loop`)."""
