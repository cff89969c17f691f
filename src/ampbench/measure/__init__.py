"""Measurement, one concern a module: ``clock`` (time on the device), ``memory`` (peaks and the bytes of
activations, parameters and state), ``stats`` (percentiles and intervals; numpy only), ``flops`` (counted
FLOPs and the datasheet peaks), ``sysmon`` (CPU, memory and GPU sampled during training).

Imports nothing itself, so ``from ampbench.measure import stats`` pulls in no torch.
"""
