"""The parts in loops written the way client code is written (CleanRL, the PyTorch examples)."""
