"""Stage 5a, attribution: failing items as query gradients (`queries`), preconditioners (`precondition`), the pure
scoring steps (`scoring`, `windows`, `rerank`, `checkpoints`) and the engine that runs them (`engine`)."""
