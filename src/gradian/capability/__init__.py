"""Stage 2, capability: how the fine-tune moved the eval metric, with a paired bootstrap interval."""
