"""Training: one optimizer step (step), the loop and its state (engine), epochs, checkpoints, Ctrl-C and repeats
(runner), the saved state (checkpoint), the processes under torchrun (distributed), the run's figures (metrics),
and what is measured beside the loop: activation bytes and the accumulation check (probes), the fp16 numerics
audit (numerics) and the step profile (profiling).

Imports nothing itself, so ``from ampbench.train import distributed`` pulls in no training code.
"""
