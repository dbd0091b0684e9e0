"""The tensor parts' proofs, one file per part (``copy_correct/X.py`` -> ``test_X.py``): one process, seconds."""
