"""The Lightning adapters' proofs (``copy_correct/lightning/X.py`` -> ``test_X.py``), in one process."""
