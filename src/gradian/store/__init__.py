"""Stage 4c, the gradient index on disk: checksummed, resumable shards keyed by row content (`index`), how rows are
encoded (`encoding`), the manifest and lock, reading rows back in chunks (`rows`), and the build loop (`build`)."""
