"""Worker scripts the multi-process tests start: one process per rank, each saving what it measured."""
