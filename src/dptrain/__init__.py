"""dptrain: differentially private training for PyTorch."""
