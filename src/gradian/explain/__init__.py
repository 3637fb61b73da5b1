"""Stage 5, explaining a ranking: sentence spans of the top rows (`spans`), clusters of rows that act alike
(`clusters`), how much of each failure the fine-tune owns (`blame`), and the simple baselines (`baselines`)."""
