"""One module per wire dialect a harness may speak."""
