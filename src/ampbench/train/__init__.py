"""Training: the loop and its state (engine), epochs, checkpoints, Ctrl-C and repeats (runner), the saved state
(checkpoint), the processes under torchrun (distributed), and the run's figures (metrics).

Imports nothing itself, so ``from ampbench.train import distributed`` pulls in no training code.
"""
